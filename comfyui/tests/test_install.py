"""The way ComfyUI users install a node pack: the repository cloned into ComfyUI/custom_nodes and its
requirements.txt installed the way ComfyUI-Manager installs it (pip, run in the clone's folder). Each case starts a
fresh Python on ComfyUI with that custom_nodes folder and runs ComfyUI's own loading of custom nodes
(`nodes.init_external_custom_nodes`, what ComfyUI runs at start), then reports the nodes it registered, where
paroattn came from, and what ComfyUI logged.

The install goes to a folder of its own (`pip install --target`, put first on the path of that Python) rather than
into this environment, which keeps the paroattn of this checkout; `--no-deps`, as paroattn's dependencies (torch
among them) are here already and must not be resolved again.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACK_NODES = ("LoadPAROPlan", "ApplyPARO", "PAROCalibrate", "LoadPARODemoModel", "PARODemoTextEncode",
              "EmptyPARODemoVideo", "PARODemoFrames")
HINT = "paroattn's ComfyUI nodes need the paroattn package in ComfyUI's Python"

# Runs in the fresh Python: argv = ComfyUI folder, custom_nodes folder, "missing" (paroattn hidden) or "present"
LOAD_CUSTOM_NODES = r'''
import asyncio, importlib.abc, json, logging, sys

comfyui, custom_nodes, paroattn = sys.argv[1:4]
if paroattn == "missing":
    class HideParoattn(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "paroattn" or name.startswith("paroattn."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, HideParoattn())

records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append(record.getMessage())

logging.basicConfig(level=logging.INFO, handlers=[Keep()])
sys.path.insert(0, comfyui)
from comfy.cli_args import args

args.cpu = True
import folder_paths

folder_paths.folder_names_and_paths["custom_nodes"] = ([custom_nodes], set())
import nodes

asyncio.run(nodes.init_external_custom_nodes())
where = sys.modules["paroattn"].__file__ if "paroattn" in sys.modules else None
registered = {name: getattr(cls, "RELATIVE_PYTHON_MODULE", None) for name, cls in nodes.NODE_CLASS_MAPPINGS.items()}
print("RESULT " + json.dumps({"nodes": registered, "paroattn": where, "log": records}))
'''


def clone_into_custom_nodes(root: Path) -> Path:
    """A clone of this checkout (its tracked and new files, as `git clone` of it would give once committed) in
    root/custom_nodes/paroattn."""
    target = root / "custom_nodes" / "paroattn"
    files = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, files):
        source = REPO / name
        if source.is_file():  # a file deleted in the working tree is still listed until committed
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target / name)
    return target


def load_custom_nodes(comfyui: Path, custom_nodes: Path, paroattn: str, pythonpath: Path | None = None) -> dict:
    script = custom_nodes.parent / "load_custom_nodes.py"
    script.write_text(LOAD_CUSTOM_NODES)
    env = {**os.environ, "PYTHONPATH": str(pythonpath) if pythonpath else ""}
    done = subprocess.run([sys.executable, str(script), str(comfyui), str(custom_nodes), paroattn], env=env,
                          cwd=custom_nodes.parent, capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def cloned(comfy, tmp_path_factory) -> Path:
    return clone_into_custom_nodes(tmp_path_factory.mktemp("comfyui-install"))


def test_clone_and_requirements_install_give_the_nodes_with_paroattn_from_the_clone(cloned):
    import comfy_env

    target = cloned.parents[1] / "site"
    # what ComfyUI-Manager runs for each line of requirements.txt, in the clone's folder
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(target),
                              "-r", "requirements.txt"], cwd=cloned, capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    assert (target / "paroattn" / "__init__.py").is_file() and list(target.glob("paroattn-*.dist-info"))

    result = load_custom_nodes(comfy_env.comfyui_dir(), cloned.parent, "present", pythonpath=target)
    assert Path(result["paroattn"]).resolve() == (target / "paroattn" / "__init__.py").resolve()
    assert {name: result["nodes"].get(name) for name in PACK_NODES} == dict.fromkeys(PACK_NODES,
                                                                                     "custom_nodes.paroattn")
    assert not [line for line in result["log"] if "IMPORT FAILED" in line or "Cannot import" in line]


def the_one_line_hint(result: dict, cloned: Path) -> str:
    """The pack's import failure as ComfyUI logged it: no node registered, one log line, the hint on one line."""
    assert not set(PACK_NODES) & set(result["nodes"])
    failed = [line for line in result["log"] if line.startswith(f"Cannot import {cloned} module for custom nodes:")]
    assert len(failed) == 1, result["log"]
    hint = failed[0].split("module for custom nodes: ", 1)[1]
    assert "\n" not in hint and hint.startswith(HINT), hint
    return hint


def test_without_paroattn_comfyui_logs_one_line_saying_how_to_install_it(cloned):
    import comfy_env

    result = load_custom_nodes(comfy_env.comfyui_dir(), cloned.parent, "missing")
    hint = the_one_line_hint(result, cloned)
    assert f"`cd {cloned} && {sys.executable} -m pip install -r requirements.txt`" in hint
    assert "No module named 'paroattn'" in hint
    assert any(re.search(rf"\(IMPORT FAILED\): {re.escape(str(cloned))}$", line) for line in result["log"])


def test_the_clone_carries_the_registry_metadata_comfyui_reads(cloned):
    from comfy_config import config_parser
    from comfyui_version import __version__ as comfyui_version
    from packaging.specifiers import SpecifierSet

    config = config_parser.extract_node_configuration(str(cloned))
    project, comfy = config.project, config.tool_comfy
    assert project.name == "paroattn" and "comfyui" not in project.name.lower()  # the registry's node id
    assert re.fullmatch(r"\d+\.\d+\.\d+", project.version)
    assert re.fullmatch(r"https://github\.com/[\w.-]+/[\w.-]+", project.urls.repository)
    assert comfy.publisher_id and comfy.display_name
    assert comfyui_version in SpecifierSet(project.supported_comfyui_version)
    # the icon: a file of this repository, where its URL on the repository's main branch points
    raw = project.urls.repository.replace("https://github.com/", "https://raw.githubusercontent.com/") + "/main/"
    assert comfy.icon.startswith(raw)
    icon = (cloned / comfy.icon[len(raw):]).read_text()
    assert re.search(r'<svg[^>]* width="400" height="400"', icon)  # square, at most 400 x 400 pixels


def test_with_a_paroattn_older_than_the_pack_comfyui_logs_one_line_saying_how_to_update_it(cloned):
    import comfy_env

    stale = cloned.parents[1] / "stale"  # a paroattn that imports but lacks what the nodes import from it
    (stale / "paroattn").mkdir(parents=True)
    (stale / "paroattn" / "__init__.py").write_text('__version__ = "0.0.1"\n')
    result = load_custom_nodes(comfy_env.comfyui_dir(), cloned.parent, "present", pythonpath=stale)
    assert Path(result["paroattn"]).resolve() == (stale / "paroattn" / "__init__.py").resolve()
    hint = the_one_line_hint(result, cloned)
    assert f"the paroattn at {stale / 'paroattn'} does not serve this pack: cannot import name" in hint
    assert f"`cd {cloned} && {sys.executable} -m pip install -r requirements.txt`" in hint
