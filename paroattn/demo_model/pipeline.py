"""The demo model as a diffusers pipeline folder, to try `paro calibrate`, `paro inspect` and `paro generate`
offline (`paro demo-pipeline DIR` writes it).

The folder is what `DemoVideoPipeline.save_pretrained` writes: `model_index.json` and the `transformer/`,
`text_encoder/` and `scheduler/` folders of the shipped model (copied as they are shipped, half-precision
weights included), plus `prompts.txt`, the demo's calibration prompts in its vocabulary. It is the pipeline
`paro demo` runs, so a prompt means the same thing in both and a plan calibrated on the folder is one the demo
could have shipped. diffusers' `DiffusionPipeline.from_pretrained` looks pipeline classes up in diffusers only;
`DemoVideoPipeline.from_pretrained(DIR)` loads the folder, and so do the `paro` commands.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from .model import ASSETS

PIPELINE_CLASS = "DemoVideoPipeline"
PROMPTS_FILE = "prompts.txt"
COMPONENTS = {  # component -> (library, class), as DemoVideoPipeline.save_pretrained records them
    "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
    "text_encoder": ("paroattn.demo_model.model", "WordTextEncoder"),
    "transformer": ("diffusers", "WanTransformer3DModel"),
}


def pipeline_class_name(model_dir: str | Path) -> str | None:
    """`_class_name` of `model_dir/model_index.json`, or None where there is no readable one."""
    try:
        index = json.loads((Path(model_dir) / "model_index.json").read_text())
    except (OSError, ValueError):
        return None
    name = index.get("_class_name") if isinstance(index, dict) else None
    return name if isinstance(name, str) else None


def is_demo_pipeline(model_dir: str | Path) -> bool:
    """Whether `model_dir` is a folder of the demo model's pipeline (`write_demo_pipeline`)."""
    return pipeline_class_name(model_dir) == PIPELINE_CLASS


def prompts_problem(model_dir: str | Path, prompts: list[str]) -> str | None:
    """Why the demo pipeline in `model_dir` cannot read one of `prompts` (words outside its text encoder's
    vocabulary, read from its config), or None; None too for any other folder."""
    if not is_demo_pipeline(model_dir):
        return None
    from .model import prompt_problem

    try:
        config = json.loads((Path(model_dir) / "text_encoder" / "config.json").read_text())
        vocabulary, max_words = list(config["vocabulary"]), int(config["max_words"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # the pipeline reports an unreadable encoder when it loads
    for prompt in prompts:
        if problem := prompt_problem(prompt, vocabulary, max_words):
            return problem
    return None


def target_problem(directory: str | Path) -> str | None:
    """Why the pipeline folder cannot be written at `directory`, or None: it must not exist yet (or be an empty
    folder), so that nothing of an earlier one is overwritten, and its parent must be writable."""
    from ..files import folder_problem

    directory = Path(directory)
    if str(directory).strip() in ("", "."):
        return "DIR is empty: pass the path of a new folder, e.g. `paro demo-pipeline demo-pipeline`"
    if directory.exists() and not directory.is_dir():
        return f"{directory} is an existing file: pass the path of a new folder"
    if directory.is_dir() and any(directory.iterdir()):
        return f"{directory} exists and is not empty: pass a new folder (nothing in an existing one is replaced)"
    return folder_problem(directory.parent, "the folder of DIR", keep=False)


def write_demo_pipeline(directory: str | Path) -> Path:
    """Write the demo model's pipeline folder at `directory` (a new or empty folder) and return its path. The
    folder is assembled beside it and renamed into place, so an interrupted run leaves nothing behind."""
    from ..files import folder_problem
    from .data import CALIBRATION_PROMPTS

    directory = Path(directory)
    if problem := target_problem(directory):
        raise ValueError(problem)
    if problem := folder_problem(directory.parent, "the folder of DIR"):
        raise ValueError(problem)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
    try:
        for component in COMPONENTS:
            # plain copies: the files get the permissions of anything else this process writes
            shutil.copytree(ASSETS / component, staging / component, copy_function=shutil.copyfile)
        index = {"_class_name": PIPELINE_CLASS, "_diffusers_version": _diffusers_version(),
                 **{name: list(entry) for name, entry in COMPONENTS.items()}}
        (staging / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
        (staging / PROMPTS_FILE).write_text(
            "# calibration prompts of the demo model (its vocabulary: paroattn.demo_model.data.VOCABULARY)\n"
            + "\n".join(CALIBRATION_PROMPTS) + "\n")
        staging.chmod(0o777 & ~_umask())
        if directory.is_dir():  # an empty folder the user made: replaced by the full one
            directory.rmdir()
        staging.rename(directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return directory


def _diffusers_version() -> str:
    import diffusers

    return diffusers.__version__


def _umask() -> int:
    import os

    umask = os.umask(0o022)  # reading the umask means setting it: set it straight back
    os.umask(umask)
    return umask
