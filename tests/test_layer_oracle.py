"""Every self-attention layer of a PARO run against an oracle that knows which plan entry it must use.

The pipeline tests only check that a sparse plan gives a finite output that differs from dense, so
they pass even when every layer is handed layer 0's orders and mask, the wrong bucket's masks, another
head's order or a transposed mask. Here, for tiny models of every family:

- plans are built so that every (bucket, layer, head) mask is distinct and not symmetric and the
  heads of a layer have different token orders (asserted, so the tests cannot become vacuous);
- forward hooks record each self-attention module's inputs and output during the PARO run, and the
  test recomputes that output with the family adapter's `qkv` -> `rotate` (the model's own RoPE, not
  the op's fused one) -> `paro_attention_reference` -> `finish`, taking orders and mask from the plan at
  the module's position in the model and at the bucket the test derives from the timestep itself;
- one generation crosses buckets: several forward calls at falling timesteps, and a 3-step pipeline.

That oracle shares the token reordering of `paroattn.layout` with the op, so a fault there (say, the
text prefix permuted along with the grid) moves both. The last tests check the op against attention
built from first principles instead: each grid token's (f, h, w) sorted by the order's axes, the
prefix kept first, the block mask expanded through that permutation.
"""

from __future__ import annotations

import inspect
import itertools
import math

import pytest
import torch
from tiny_models import TINY_BLOCK, tiny_call_kwargs, tiny_forward_inputs, tiny_pipeline, tiny_transformer

from paroattn import Plan, TokenLayout, paro_attention
from paroattn.kernels import reference
from paroattn.kernels.reference import paro_attention_reference
from paroattn.layout import ORDERS
from paroattn.pipelines import apply, family_of, self_attention_layers
from paroattn.plan import model_fingerprint

# same float32 math on both sides; only the RoPE route (the op's tables vs the model's code) differs
ATOL = RTOL = 1e-5
# a wrong plan entry moves layer outputs by far more than the tolerance (checked in the first test)
VISIBLE = 1e-3


# -- the test's own geometry, independent of the processor's bookkeeping -----------------------------


def grid_permutation(layout: TokenLayout, order: str) -> list[int]:
    """Original position of each reordered position: the prefix first and unchanged, then the grid
    tokens sorted by their coordinates along the order's axes, outermost first, then the suffix unchanged."""
    coords = list(itertools.product(range(layout.frames), range(layout.height), range(layout.width)))
    axis = {"F": 0, "H": 1, "W": 2}
    ranked = sorted(range(len(coords)), key=lambda i: tuple(coords[i][axis[a]] for a in order))
    end = layout.prefix + len(coords)
    return list(range(layout.prefix)) + [layout.prefix + i for i in ranked] + list(range(end, end + layout.suffix))


def bucket_at(edges: list[float], t: float) -> int:
    """Bucket b holds edges[b] >= t > edges[b + 1] (the last one also t = edges[-1])."""
    for b in range(len(edges) - 1):
        if t > edges[b + 1] or b == len(edges) - 2:
            return b
    raise AssertionError("unreachable")


def attention_modules(transformer) -> list[torch.nn.Module]:
    """Self-attention modules in plan layer order, listed from the model's structure."""
    name = type(transformer).__name__
    if name in ("CogVideoXTransformer3DModel", "LTXVideoTransformer3DModel", "LTX2VideoTransformer3DModel"):
        return [block.attn1 for block in transformer.transformer_blocks]
    if name in ("WanTransformer3DModel", "SkyReelsV2Transformer3DModel"):
        return [block.attn1 for block in transformer.blocks]
    if name == "WanVACETransformer3DModel":  # the main blocks, then the VACE blocks (over the control tokens)
        return [block.attn1 for block in transformer.blocks] + [block.attn1 for block in transformer.vace_blocks]
    if name in ("QwenImageTransformer2DModel", "HunyuanVideo15Transformer3DModel"):
        return [block.attn for block in transformer.transformer_blocks]
    if name in ("FluxTransformer2DModel", "HunyuanVideoTransformer3DModel", "Flux2Transformer2DModel"):
        return [b.attn for b in transformer.transformer_blocks] + [b.attn for b in transformer.single_transformer_blocks]
    raise AssertionError(name)


def forward_arguments(transformer, args, kwargs) -> dict:
    return inspect.signature(transformer.forward).bind_partial(*args, **kwargs).arguments


def call_timestep(transformer, arguments) -> float:
    """The call's timestep on the plans' 0..1000 scale: CogVideoX passes ints 0..999, Wan floats
    0..1000, Flux t / 1000."""
    t = float(arguments["timestep"].flatten()[0])
    scaled = ("FluxTransformer2DModel", "Flux2Transformer2DModel", "QwenImageTransformer2DModel")
    return 1000.0 * t if type(transformer).__name__ in scaled else t


def call_layout(transformer, arguments) -> TokenLayout:
    """Token layout of a forward call from its tensor shapes."""
    name, config = type(transformer).__name__, transformer.config
    latents = arguments["hidden_states"]
    if name == "CogVideoXTransformer3DModel":  # [B, F, C, H, W], text first
        _, frames, _, height, width = latents.shape
        p, pt = config.patch_size, config.patch_size_t or 1
        return TokenLayout(arguments["encoder_hidden_states"].shape[1], frames // pt, height // p, width // p)
    if name in ("WanTransformer3DModel", "SkyReelsV2Transformer3DModel", "WanVACETransformer3DModel"):
        # [B, C, F, H, W], no text in self-attention
        _, _, frames, height, width = latents.shape
        pt, ph, pw = config.patch_size
        return TokenLayout(0, frames // pt, height // ph, width // pw)
    if name == "HunyuanVideoTransformer3DModel":  # [B, C, F, H, W], text after the video
        _, _, frames, height, width = latents.shape
        p, pt = config.patch_size, config.patch_size_t
        return TokenLayout(0, frames // pt, height // p, width // p, suffix=arguments["encoder_hidden_states"].shape[1])
    if name in ("LTXVideoTransformer3DModel", "LTX2VideoTransformer3DModel"):  # packed [B, F * H * W, C], the grid in its own arguments
        return TokenLayout(0, arguments["num_frames"], arguments["height"], arguments["width"])
    if name == "HunyuanVideo15Transformer3DModel":  # [B, C, F, H, W], then MLLM, ByT5 and vision tokens
        _, _, frames, height, width = latents.shape
        text = sum(arguments[key].shape[1] for key in ("encoder_hidden_states", "encoder_hidden_states_2",
                                                       "image_embeds"))
        return TokenLayout(0, frames // config.patch_size_t, height // config.patch_size, width // config.patch_size,
                           suffix=text)
    if name == "QwenImageTransformer2DModel":  # packed [B, rows * cols, C], text first, the grid in img_shapes
        (frames, rows, cols), = arguments["img_shapes"][0]
        return TokenLayout(arguments["encoder_hidden_states"].shape[1], frames, rows, cols)
    if name == "Flux2Transformer2DModel":  # packed, text first; ids are (time, row, column, text position)
        ids = arguments["img_ids"][0]
        rows, cols = int(ids[:, 1].max()) + 1, int(ids[:, 2].max()) + 1
        return TokenLayout(arguments["encoder_hidden_states"].shape[1], 1, rows, cols)
    if name == "FluxTransformer2DModel":  # packed [B, rows * cols, C], text first
        ids = arguments["img_ids"]
        rows, cols = int(ids[:, 1].max()) + 1, int(ids[:, 2].max()) + 1
        return TokenLayout(arguments["encoder_hidden_states"].shape[1], 1, rows, cols)
    raise AssertionError(name)


# -- plans whose every entry is distinguishable --------------------------------------------------------


def discriminating_plan(transformer, layout: TokenLayout, bucket_edges: list[float], seed: int = 0) -> Plan:
    """Random orders and masks, redrawn until each head of a layer has its own token permutation and
    every (bucket, layer, head) mask is distinct from every other and from its own transpose."""
    g = torch.Generator().manual_seed(seed)
    modules = attention_modules(transformer)
    L, H = len(modules), int(modules[0].heads)
    permutations = [grid_permutation(layout, order) for order in ORDERS]
    orders = torch.zeros(L, H, dtype=torch.int8)
    for layer in range(L):
        while len({tuple(permutations[int(o)]) for o in orders[layer]}) < H:
            orders[layer] = torch.randint(0, len(ORDERS), (H,), generator=g)
    n = -(-layout.seq_len // TINY_BLOCK)
    masks, seen = [], set()
    while len(masks) < (len(bucket_edges) - 1) * L * H:
        mask = (torch.rand(n, n, generator=g) < 0.5) | torch.eye(n, dtype=torch.bool)  # plans keep the diagonal
        key = tuple(mask.flatten().tolist())
        if not torch.equal(mask, mask.T) and key not in seen:
            seen.add(key)
            masks.append(mask)
    plan = Plan(
        model_class=type(transformer).__name__,
        model_fingerprint=model_fingerprint(transformer.config),
        layout=layout,
        block_size=(TINY_BLOCK, TINY_BLOCK),
        orders=orders,
        block_mask=torch.stack(masks).view(len(bucket_edges) - 1, L, H, n, n),
        bucket_edges=bucket_edges,
    )
    assert_plan_discriminates(plan)
    return plan


def assert_plan_discriminates(plan: Plan) -> None:
    """What the mutations below need to be visible: a plan entry used in place of another differs."""
    B, L, H = plan.block_mask.shape[:3]
    assert B >= 2 and L >= 2 and H >= 2
    flat = plan.block_mask.flatten(0, 2)
    assert len({tuple(m.flatten().tolist()) for m in flat}) == B * L * H, "a mask repeats across buckets/layers/heads"
    assert all(not torch.equal(m, m.T) for m in flat), "a symmetric mask hides a transpose"
    assert plan.achieved_density() < 1.0
    for layer in range(L):
        heads = {tuple(grid_permutation(plan.layout, ORDERS[int(o)])) for o in plan.orders[layer]}
        assert len(heads) == H, f"layer {layer}: two heads share a token order"


def _replace(plan: Plan, **changes) -> Plan:
    """`plan` with some tensors swapped (density and dense recomputed)."""
    return Plan(**{**plan.__dict__, **changes, "density": None, "dense": None})


# -- recording every layer and recomputing it ----------------------------------------------------------


class LayerRecorder:
    """Forward hooks: each transformer call's bucket and layout (from its own arguments), and each
    self-attention module's inputs and output, tagged with the module's position in the model."""

    def __init__(self, transformer, plan: Plan):
        self.transformer, self.plan = transformer, plan
        self.modules = attention_modules(transformer)
        self.forwards: list[tuple[float, int, TokenLayout]] = []  # (timestep 0..1000, bucket, layout)
        self.calls: list[dict] = []
        self.handles = []

    def __enter__(self):
        self.handles.append(self.transformer.register_forward_pre_hook(self._on_forward, with_kwargs=True))
        for layer, module in enumerate(self.modules):
            self.handles.append(module.register_forward_hook(self._on_attention(layer), with_kwargs=True))
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()

    def _on_forward(self, module, args, kwargs):
        arguments = forward_arguments(module, args, kwargs)
        t = call_timestep(module, arguments)
        self.forwards.append((t, bucket_at(self.plan.bucket_edges, t), call_layout(module, arguments)))

    def _on_attention(self, layer):
        def hook(module, args, kwargs, output):
            arguments = dict(inspect.signature(module.forward).bind(*args, **kwargs).arguments)
            arguments.update(arguments.pop("cross_attention_kwargs", None) or arguments.pop("kwargs", None) or {})
            self.calls.append({
                "forward": len(self.forwards) - 1,
                "layer": layer,
                "module": module,
                "hidden_states": arguments["hidden_states"].clone(),
                "encoder_hidden_states": _clone(arguments.get("encoder_hidden_states")),
                "rotary": next((arguments[k] for k in ("image_rotary_emb", "rotary_emb", "query_rotary_emb")
                                if arguments.get(k) is not None), None),
                "attention_mask": arguments.get("attention_mask"),
                "output": _clone(output),
            })
        return hook


def _clone(x):
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        return x.clone()
    return tuple(t.clone() for t in x)


def expected_output(adapter, plan: Plan, call: dict, layout: TokenLayout, bucket: int):
    """The layer's output with the plan entry at (bucket, the module's position)."""
    attn, layer = call["module"], call["layer"]
    split = adapter.qkv(attn, call["hidden_states"], call["encoder_hidden_states"], call["rotary"])
    split = adapter.rotate(split)
    suffix_mask = None
    mask = call.get("attention_mask")
    if mask is not None and mask.dim() == 4:  # HunyuanVideo: [B, 1, 1, N], False at padded text keys
        suffix_mask = mask[:, 0, 0, layout.seq_len - layout.suffix:]
    elif mask is not None:  # HunyuanVideo 1.5: the text's own mask [B, T], False at padding
        suffix_mask = mask.bool()
    out = paro_attention_reference(
        split.q, split.k, split.v, layout, plan.orders[layer].long(), plan.block_mask[bucket, layer],
        *plan.block_size, suffix_mask=suffix_mask,
    )
    return adapter.finish(attn, out, split)


def as_tuple(x) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def check_every_layer(transformer, plan: Plan, recorder: LayerRecorder) -> set[int]:
    """Compare each recorded layer call with its oracle; return the buckets the run went through."""
    adapter = family_of(transformer)
    L = len(recorder.modules)
    assert len(recorder.calls) == L * len(recorder.forwards), "a self-attention layer was not called once per forward"
    for call in recorder.calls:
        t, bucket, layout = recorder.forwards[call["forward"]]
        assert layout == plan.layout
        with torch.no_grad():
            expected = expected_output(adapter, plan, call, layout, bucket)
        for got, want in zip(as_tuple(call["output"]), as_tuple(expected), strict=True):
            torch.testing.assert_close(
                got, want, atol=ATOL, rtol=RTOL,
                msg=lambda m, c=call, t=t, b=bucket: f"layer {c['layer']} at t={t:.1f} (bucket {b}): {m}",
            )
    return {bucket for _, bucket, _ in recorder.forwards}


def assert_buckets_change_within_the_run(recorder: LayerRecorder) -> None:
    buckets = [bucket for _, bucket, _ in recorder.forwards]
    assert len(set(buckets)) >= 2, f"the run stayed in one bucket: {buckets}"
    assert buckets == sorted(buckets), f"timesteps fall, so buckets must rise: {buckets}"


# -- tests --------------------------------------------------------------------------------------------

FORWARD_FAMILIES = ["cogvideox", "cogvideox1.5", "wan", "wan-i2v", "wan2.2-ti2v", "flux", "hunyuan_video",
                    "skyreels_v2", "wan_vace", "qwen_image", "flux2", "hunyuan_video15", "ltx", "ltx2"]
# one falling schedule through all three buckets of [1000, 750, 500, 0], two calls in the first
TIMESTEPS = [980.0, 800.0, 620.0, 150.0]


@pytest.mark.parametrize("family", FORWARD_FAMILIES)
def test_every_layer_uses_its_own_orders_and_mask_of_the_timesteps_bucket(family):
    """Forward calls at falling timesteps under one `apply`: each layer's output is the reference op's
    with that layer's orders and that bucket's mask. Also shows the oracle would notice a wrong entry."""
    transformer = tiny_transformer(family)
    calls = [tiny_forward_inputs(transformer, timestep=t, seed=i) for i, t in enumerate(TIMESTEPS)]
    layout = call_layout(transformer, forward_arguments(transformer, (), calls[0]))
    plan = discriminating_plan(transformer, layout, [1000.0, 750.0, 500.0, 0.0], seed=1)
    assert attention_modules(transformer) == [
        transformer.get_submodule(key[: -len(".processor")]) for key in self_attention_layers(transformer)
    ]

    with torch.no_grad(), apply(transformer, plan, backend="torch"), LayerRecorder(transformer, plan) as recorder:
        for inputs in calls:
            transformer(**inputs)
    assert_buckets_change_within_the_run(recorder)
    assert check_every_layer(transformer, plan, recorder) == {0, 1, 2}

    # the oracle is sensitive to each kind of wrong entry on this model (not only the plan's structure)
    adapter, L = family_of(transformer), plan.num_layers
    call = next(c for c in recorder.calls if c["layer"] == L - 1 and recorder.forwards[c["forward"]][1] == 1)
    right = as_tuple(expected_output(adapter, plan, call, layout, 1))[0]
    wrong_plans = {
        "layer 0": _replace(plan, orders=plan.orders[[0] * L], block_mask=plan.block_mask[:, [0] * L]),
        "other bucket": _replace(plan, block_mask=plan.block_mask[[0, 0, 0]]),
        "heads rolled": _replace(plan, orders=plan.orders.roll(1, dims=1)),
        "transposed": _replace(plan, block_mask=plan.block_mask.transpose(-1, -2)),
    }
    for what, wrong in wrong_plans.items():
        with torch.no_grad():
            moved = as_tuple(expected_output(adapter, wrong, call, layout, 1))[0]
        assert (moved - right).abs().max() > VISIBLE, what


PIPELINE_LAYOUTS = {
    # 9 frames of 64 x 64 -> 3 latent frames of 8 x 8 (VAE 4 in time, 8 in space) -> 2 x 2 patches
    "cogvideox": TokenLayout(8, 3, 4, 4),
    "wan": TokenLayout(0, 3, 4, 4),
    # 9 frames of 128 x 128 -> 3 latent frames of 8 x 8 (Wan 2.2's VAE: 16 in space) -> 2 x 2 patches
    "wan2.2-ti2v": TokenLayout(0, 3, 4, 4),
    # 96 x 96 -> 12 x 12 latents (VAE 8) -> 6 x 6 tokens of 2 x 2 packed latents, after 8 text tokens
    "flux": TokenLayout(8, 1, 6, 6),
    # 9 frames of 64 x 64 -> 3 x 4 x 4 tokens, then 21 text tokens (the prompt's 7, padded)
    "hunyuan_video": TokenLayout(0, 3, 4, 4, suffix=21),
}


@pytest.mark.parametrize("family", ["cogvideox", "wan", "wan2.2-ti2v", "flux", "hunyuan_video"])
def test_pipeline_generation_crosses_buckets_and_every_layer_follows_the_plan(family):
    """A 3-step tiny pipeline run (Wan: cond and uncond calls per step, Wan 2.2 TI2V a per-token timestep;
    Flux: the pipeline's t / 1000):
    the first steps fall in bucket 0 of [1000, 500, 0] and the later ones in bucket 1; every layer call
    of every step matches the oracle for the bucket of the timestep the pipeline passed."""
    pipe = tiny_pipeline(family)
    pipe.set_progress_bar_config(disable=True)
    transformer = pipe.transformer
    plan = discriminating_plan(transformer, PIPELINE_LAYOUTS[family], [1000.0, 500.0, 0.0], seed=2)
    kwargs = {**tiny_call_kwargs(family), "num_inference_steps": 3, "output_type": "latent"}
    with torch.no_grad(), apply(pipe, plan, backend="torch"), LayerRecorder(transformer, plan) as recorder:
        pipe("a cat runs on the beach", generator=torch.Generator().manual_seed(0), **kwargs)
    assert len(recorder.forwards) == 3 * (2 if family.startswith("wan") else 1)
    assert_buckets_change_within_the_run(recorder)
    assert check_every_layer(transformer, plan, recorder) == {0, 1}


def test_expert_pair_each_expert_follows_its_own_plan_across_the_switch_and_buckets():
    """Wan 2.2 A14B-like pair, 4 steps: `transformer` at t = 1000, 858 (buckets 0, 1 of [1000, 900, 500, 0]),
    `transformer_2` at 602, 9 (buckets 1, 2). Every layer call of each expert matches the oracle with that
    expert's plan at the bucket of its timestep; bucket 1 runs on both sides of the switch, each with its own
    masks, and the other expert's plan would be seen."""
    pipe = tiny_pipeline("wan2.2")
    pipe.set_progress_bar_config(disable=True)
    edges = [1000.0, 900.0, 500.0, 0.0]
    layout = PIPELINE_LAYOUTS["wan"]
    plans = [discriminating_plan(pipe.transformer, layout, edges, seed=3),
             discriminating_plan(pipe.transformer_2, layout, edges, seed=4)]
    plans[0].expert, plans[1].expert = "transformer", "transformer_2"
    kwargs = {**tiny_call_kwargs("wan2.2"), "num_inference_steps": 4, "output_type": "latent"}
    with torch.no_grad(), apply(pipe, plans, backend="torch"), \
            LayerRecorder(pipe.transformer, plans[0]) as high, LayerRecorder(pipe.transformer_2, plans[1]) as low:
        pipe("a cat runs on the beach", generator=torch.Generator().manual_seed(0), **kwargs)
    assert len(high.forwards) == len(low.forwards) == 4  # two steps each, cond and uncond
    assert min(t for t, _, _ in high.forwards) > max(t for t, _, _ in low.forwards)
    assert check_every_layer(pipe.transformer, plans[0], high) == {0, 1}
    assert check_every_layer(pipe.transformer_2, plans[1], low) == {1, 2}

    # the oracle tells the experts' plans apart on the bucket both run
    adapter = family_of(pipe.transformer_2)
    call = next(c for c in low.calls if low.forwards[c["forward"]][1] == 1)
    right = as_tuple(expected_output(adapter, plans[1], call, layout, 1))[0]
    swapped = as_tuple(expected_output(adapter, plans[0], call, layout, 1))[0]
    assert (swapped - right).abs().max() > VISIBLE


# -- the op's reordering from first principles -----------------------------------------------------------


def first_principles_attention(q, k, v, permutations, block_mask, bq, bk):
    """Softmax attention in the original token order where token i may attend to token j iff the
    block mask allows (block of i's reordered position, block of j's reordered position);
    `permutations[h]` lists head h's original positions in reordered order."""
    B, H, N, D = q.shape
    out = torch.empty_like(q)
    for h in range(H):
        position = torch.empty(N, dtype=torch.long)  # original token -> reordered position
        position[torch.tensor(permutations[h])] = torch.arange(N)
        allowed = block_mask[h][position[:, None] // bq, position[None, :] // bk]
        scores = (q[:, h] @ k[:, h].transpose(-1, -2)) / math.sqrt(D)
        out[:, h] = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v[:, h]
    return out


@pytest.fixture(params=["fused", "loop"])
def reference_path(request, monkeypatch):
    """The reference takes one masked SDPA call for small float32 problems and a per-head loop
    otherwise: check both."""
    if request.param == "loop":
        monkeypatch.setattr(reference, "_SDPA_MASK_ELEMENTS", 0)
    return request.param


# prefixes longer than a block, so a permuted prefix moves text tokens between blocks with different
# masks (a permutation inside one block would be invisible: attention is permutation-equivariant)
OP_LAYOUTS = [TokenLayout(20, 3, 4, 5), TokenLayout(37, 1, 5, 7), TokenLayout(0, 2, 5, 3)]


@pytest.mark.parametrize("layout", OP_LAYOUTS, ids=lambda l: f"prefix{l.prefix}-{l.frames}x{l.height}x{l.width}")
def test_op_reorders_the_grid_only_as_first_principles_say(layout, reference_path):
    """One head per order (all 6), a random non-symmetric mask per head whose first rows and columns
    differ: the op and the reference equal attention whose mask is expanded through each token's
    sorted (f, h, w) coordinates, with the text prefix left in place."""
    g = torch.Generator().manual_seed(3)
    H, N, bq = len(ORDERS), layout.seq_len, TINY_BLOCK
    n = -(-N // bq)
    while True:
        mask = (torch.rand(H, n, n, generator=g) < 0.4) | torch.eye(n, dtype=torch.bool)
        if all(not torch.equal(m, m.T) and not torch.equal(m[0], m[1]) and not torch.equal(m[:, 0], m[:, 1])
               for m in mask):
            break
    orders = torch.arange(H)
    q, k, v = (torch.randn(2, H, N, 16, generator=g) for _ in range(3))

    permutations = [grid_permutation(layout, order) for order in ORDERS]
    expected = first_principles_attention(q, k, v, permutations, mask, bq, bq)
    op = paro_attention(q, k, v, layout=layout, orders=orders, block_mask=mask, block_size=bq, backend="torch")
    ref = paro_attention_reference(q, k, v, layout, orders, mask, bq, bq)
    torch.testing.assert_close(op, expected, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(ref, expected, atol=ATOL, rtol=RTOL)

    if layout.prefix > bq:  # the check itself: the prefix reversed inside each permutation would be seen
        prefix = layout.prefix
        reversed_prefix = [p[:prefix][::-1] + p[prefix:] for p in permutations]
        moved = first_principles_attention(q, k, v, reversed_prefix, mask, bq, bq)
        assert (moved - expected).abs().max() > VISIBLE
