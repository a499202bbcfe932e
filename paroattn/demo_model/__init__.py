"""The demo model of `paro demo`: a small text-to-video Wan transformer trained for this
project on procedural videos, so PARO can be measured offline and on a CPU on attention that was
learned rather than random.

- `model.py`: the model classes, `load_demo_pipeline` and its shipped weights (`assets/`);
- `data.py`: the renderer of its training videos and their captions;
- `demo.py`: `paro demo` (dense vs PARO on it) and the helpers of the quality study (QUALITY.md).

`model` and `demo` load diffusers; import the submodules directly (`from paroattn.demo_model.model import ...`).
"""
