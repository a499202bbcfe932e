"""The example workflows pass ComfyUI's own validation of a prompt: node types, links and their types, widget
values (files included: empty stand-ins under the names the workflows use) and numeric ranges. Together they show
every node of the pack."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

WORKFLOWS = sorted((Path(__file__).resolve().parents[1] / "example_workflows").glob("*.json"))
WIDGET_TYPES = ("INT", "FLOAT", "STRING", "BOOLEAN", "COMBO")
FOLDERS = {"UNETLoader": "diffusion_models", "CheckpointLoaderSimple": "checkpoints", "CLIPLoader": "text_encoders",
           "DualCLIPLoader": "text_encoders", "VAELoader": "vae", "LoadPAROPlan": "paroattn",
           "LTXVAudioVAELoader": "checkpoints", "LTXAVTextEncoderLoader": "text_encoders"}  # and the checkpoint above


def _type(spec):
    t = spec[0]
    if isinstance(t, (list, tuple)):
        return "COMBO"
    options = spec[1] if len(spec) > 1 else {}
    return str(options.get("widgetType", getattr(t, "value", t)))  # an input of several types shows this widget


def api_prompt(workflow: dict, node_classes: dict) -> dict:
    """The API prompt of a workflow as the front end saves it (widget values in the order of the node's inputs, a
    seed widget followed by its control_after_generate value)."""
    sources = {link[0]: link for link in workflow["links"]}
    prompt = {}
    for node in workflow["nodes"]:
        spec = node_classes[node["type"]].INPUT_TYPES()
        linked = {i["name"]: sources[i["link"]] for i in node["inputs"] if i.get("link") is not None}
        values = list(node.get("widgets_values", []))
        inputs = {}
        for section in ("required", "optional"):
            for name, input_spec in spec.get(section, {}).items():
                if name in linked:
                    link = linked[name]
                    inputs[name] = [str(link[1]), link[2]]
                elif _type(input_spec) in WIDGET_TYPES:
                    options = input_spec[1] if len(input_spec) > 1 else {}
                    inputs[name] = values.pop(0)
                    if options.get("control_after_generate") or name in ("seed", "noise_seed"):
                        values.pop(0)
        assert not values, f"{node['type']} (node {node['id']}) has widget values left over: {values}"
        prompt[str(node["id"])] = {"class_type": node["type"], "inputs": inputs}
    return prompt


@pytest.mark.parametrize("path", WORKFLOWS, ids=[p.stem for p in WORKFLOWS])
def test_example_workflow_is_a_valid_prompt(comfy, path):
    import execution
    import folder_paths

    workflow = json.loads(path.read_text())
    assert {"ApplyPARO", "PAROCalibrate"} & {node["type"] for node in workflow["nodes"]}
    for node in workflow["nodes"]:  # empty stand-ins for the model files it names
        if node["type"] in FOLDERS:
            folder = Path(folder_paths.get_folder_paths(FOLDERS[node["type"]])[0])
            folder.mkdir(parents=True, exist_ok=True)
            for value in node["widgets_values"]:
                if isinstance(value, str) and value.endswith(".safetensors"):
                    (folder / value).touch()
    prompt = api_prompt(workflow, comfy.NODE_CLASS_MAPPINGS)
    valid, error, outputs, node_errors = asyncio.run(execution.validate_prompt("workflow", prompt, None))
    assert valid, f"{path.name}: {error} {node_errors}"
    assert outputs, f"{path.name} has no output node"



def test_the_example_workflows_show_every_node_of_the_pack(comfy):
    import comfy_env

    shown = {node["type"] for path in WORKFLOWS for node in json.loads(path.read_text())["nodes"]}
    assert set(comfy_env.pack_module("paro_nodes").NODE_CLASS_MAPPINGS) <= shown
    assert set(comfy_env.pack_module("demo_nodes").NODE_CLASS_MAPPINGS) <= shown
