"""The graph tests need ComfyUI and its requirements (torchvision matching torch among them), which the project's
own environment does not have: `.ci/run` makes a virtual environment for them. Elsewhere they are skipped, saying
why, unless PAROATTN_COMFYUI_TESTS=1 asks for them (then a missing piece is an error)."""

from __future__ import annotations

import importlib.util
import os

import pytest

REQUIRED = os.environ.get("PAROATTN_COMFYUI_TESTS") == "1"
# what ComfyUI imports at start that the project's environment lacks
COMFYUI_MODULES = ("torchvision", "torchaudio", "torchsde", "einops", "av", "aiohttp", "comfy_kitchen", "comfy_aimdo",
                   "kornia", "spandrel", "alembic", "simpleeval", "blake3")


def _missing() -> list[str]:
    return [name for name in COMFYUI_MODULES if importlib.util.find_spec(name) is None]


@pytest.fixture(scope="session")
def comfy(tmp_path_factory):
    """ComfyUI's `nodes` module, started once with this pack and the test nodes, models under a temporary folder."""
    missing = _missing()
    if missing:
        reason = (f"ComfyUI's requirements are not installed here ({', '.join(missing)}): the graph tests run in the "
                  "virtual environment .ci/run makes for them")
        if REQUIRED:
            pytest.fail(reason)
        pytest.skip(reason)
    import comfy_env
    import helper_nodes

    return comfy_env.start(tmp_path_factory.mktemp("comfyui-models"), helper_nodes.NODES)


@pytest.fixture(scope="session")
def wan(comfy):
    """The tiny Wan 2.1 model (diffusers), saved for ComfyUI as models/diffusion_models/tiny-wan.safetensors."""
    import tiny_models

    model = tiny_models.tiny_wan()
    tiny_models.save_diffusion_model(model, tiny_models.save_wan, "tiny-wan.safetensors")
    return model
