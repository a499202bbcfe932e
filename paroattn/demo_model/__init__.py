"""The demo model of `paro demo`: a small text-to-video Wan transformer trained for this
project on procedural videos, so PARO can be measured offline and on a CPU on attention that was
learned rather than random.

- `model.py`: the model classes, `load_demo_pipeline` and its shipped weights (`assets/`);
- `data.py`: the renderer of its training videos, their captions, and the prompts of its calibration and
  quality study;
- `pipeline.py`: its pipeline written as a folder that `from_pretrained` and `paro calibrate` read.

`paro demo` is built on it (`paroattn.app.demo`). `model` loads diffusers; import the submodules directly (`from paroattn.demo_model.model import ...`).
"""
