"""The CPU workflow shipped in example_workflows/paro-demo-cpu.json, run by ComfyUI's executor as the front end
would queue it: the demo model loaded by the pack's loader, PARO calibrate sampling it densely and writing a plan,
Apply PARO with that plan, KSampler, and both videos saved. Also checked: the loader's ComfyUI model computes what
the diffusers demo transformer computes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

WORKFLOW = Path(__file__).resolve().parents[1] / "example_workflows" / "paro-demo-cpu.json"
STEPS = 2  # the workflow's 20 steps, twice, with statistics at every second step take many minutes on two cores


def test_demo_model_in_comfyui_is_the_diffusers_demo_transformer(comfy):
    import comfy_env

    from paroattn.demo_model.model import load_demo_pipeline

    demo = comfy_env.pack_module("demo_nodes")
    model, encoder = demo.load_demo_model()
    pipe = load_demo_pipeline()
    prompt = "blue square rotating slowly and red ring moving up quickly, pan left, dotted background"
    states = pipe.encode_prompt([prompt])
    (conditioning,) = demo.PARODemoTextEncode().encode(encoder, prompt)
    torch.testing.assert_close(conditioning[0][0], states, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="words the demo model does not know: \\['dog'\\]"):
        demo.PARODemoTextEncode().encode(encoder, "red dog")
    x = torch.randn(2, 3, 8, 32, 32, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([900.0, 250.0])
    with torch.no_grad():
        expected = pipe.transformer(hidden_states=x, timestep=t, encoder_hidden_states=states.expand(2, -1, -1),
                                    return_dict=False)[0]
        got = model.model.diffusion_model(x, t, states.expand(2, -1, -1))
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()
    # the sampler's view of the model: pixels as the latent, diffusers' flow schedule (shift 2) on 0..1000
    assert model.model.latent_format.process_in(x).equal(x)
    sigma = torch.tensor([0.5])
    assert model.model.model_sampling.timestep(sigma).item() == pytest.approx(500.0)
    assert model.model.model_sampling.sigma(torch.tensor([500.0])).item() == pytest.approx(2 * 0.5 / (1 + 0.5))


def test_the_cpu_workflow_calibrates_applies_and_generates(comfy, tmp_path):
    import comfy_env
    import folder_paths
    import helper_nodes
    from test_workflows import api_prompt

    from paroattn import Plan

    workflow = json.loads(WORKFLOW.read_text())
    prompt = api_prompt(workflow, comfy.NODE_CLASS_MAPPINGS)
    by_type = {node["class_type"]: key for key, node in prompt.items()}
    calibrate, sampler = prompt[by_type["PAROCalibrate"]], prompt[by_type["KSampler"]]
    calibrate["inputs"]["steps"] = sampler["inputs"]["steps"] = STEPS
    # keep both videos' latents too (the workflow saves them as WEBP files)
    prompt["keep_dense"] = {"class_type": "KeepLatent", "inputs": {"samples": [by_type["PAROCalibrate"], 1],
                                                                   "key": "demo-dense"}}
    prompt["keep_paro"] = {"class_type": "KeepLatent", "inputs": {"samples": [by_type["KSampler"], 0],
                                                                  "key": "demo-paro"}}
    outputs = [key for key, node in prompt.items() if node["class_type"] in ("SaveAnimatedWEBP", "KeepLatent")]
    folder_paths.set_output_directory(str(tmp_path / "output"))
    plan_file = Path(folder_paths.get_folder_paths("paroattn")[0]) / f"{calibrate['inputs']['filename']}.safetensors"
    plan_file.unlink(missing_ok=True)

    ok, messages = comfy_env.run(prompt, outputs)
    assert ok, comfy_env.error_message(messages)

    plan = Plan.load(plan_file)
    assert (plan.model_class, plan.num_layers, plan.num_heads) == ("WanTransformer3DModel", 8, 4)
    assert plan.target_density == calibrate["inputs"]["density"]
    texts = [text for event, data in messages if event == "executed"
             for text in (data.get("output") or {}).get("text", [])]
    assert any(text.startswith("PARO on: WanTransformer3DModel") for text in texts), texts
    saved = sorted(p.relative_to(tmp_path / "output").as_posix() for p in (tmp_path / "output").rglob("*.webp"))
    assert saved == ["paro-demo/dense_00001_.webp", "paro-demo/paro_00001_.webp"]

    dense = helper_nodes.RECORDS["demo-dense"][-1]
    paro = helper_nodes.RECORDS["demo-paro"][-1]
    assert dense.shape == paro.shape == (1, 3, 8, 32, 32)
    # the same seed and schedule: PARO's video is the dense one up to the plan's skipped blocks
    psnr = 10 * torch.log10(4 / (paro.clamp(-1, 1) - dense.clamp(-1, 1)).pow(2).mean())
    assert 15 < psnr < 60, f"PSNR of PARO against dense: {psnr:.1f} dB"
