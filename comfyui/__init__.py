"""paroattn's ComfyUI nodes: PARO plans (per-head token orders and static block-sparse masks) in ComfyUI graphs.

Load PARO plan -> Apply PARO -> any sampler; PARO calibrate writes plans; the demo model's nodes run the whole
workflow on a CPU. ComfyUI loads this pack from a clone of the repository in ComfyUI/custom_nodes (the repository's
root `__init__.py` imports this one) or from a copy of this folder; either way the `paroattn` package must be
installed in ComfyUI's Python (README.md, Install).
"""

import sys
import traceback
from pathlib import Path

_CHECKOUT = Path(__file__).resolve().parents[1]  # the repository, where this folder is part of a clone


def install_hint(problem: str) -> str:
    """One line: what is wrong with paroattn in this Python, and the command that installs it."""
    python = sys.executable or "python"
    if (_CHECKOUT / "requirements.txt").is_file() and (_CHECKOUT / "paroattn" / "__init__.py").is_file():
        how = f"cd {_CHECKOUT} && {python} -m pip install -r requirements.txt"
    else:
        how = f"{python} -m pip install <a checkout of the paroattn repository>"
    return f"paroattn's ComfyUI nodes need the paroattn package in ComfyUI's Python ({problem}): run `{how}` and restart ComfyUI"


def _inside(exc: BaseException, folder: Path) -> bool:
    """Whether the import that raised `exc` ran in a file under `folder`."""
    return any(Path(frame.filename).resolve().is_relative_to(folder) for frame in traceback.extract_tb(exc.__traceback__))


try:
    import paroattn
except ImportError as exc:
    raise ImportError(install_hint(f"import paroattn failed: {exc}")) from None

try:
    from .demo_nodes import NODE_CLASS_MAPPINGS as _DEMO_NODES
    from .demo_nodes import NODE_DISPLAY_NAME_MAPPINGS as _DEMO_NAMES
    from .paro_nodes import NODE_CLASS_MAPPINGS as _PARO_NODES
    from .paro_nodes import NODE_DISPLAY_NAME_MAPPINGS as _PARO_NAMES
except ImportError as exc:
    # a paroattn older than this pack (a name it lacks), or one installed without its dependencies
    if not ((exc.name or "").startswith("paroattn") or _inside(exc, Path(paroattn.__file__).resolve().parent)):
        raise
    raise ImportError(install_hint(f"the paroattn at {Path(paroattn.__file__).parent} does not serve this pack: "
                                   f"{exc}")) from None

NODE_CLASS_MAPPINGS = {**_PARO_NODES, **_DEMO_NODES}
NODE_DISPLAY_NAME_MAPPINGS = {**_PARO_NAMES, **_DEMO_NAMES}

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
