"""Nodes the graph tests add to ComfyUI: conditioning without a text encoder, records of what ran, an interrupt."""

from __future__ import annotations

import torch

RECORDS: dict[str, list] = {}


BYT5_DIM = 1472  # the width of ComfyUI's ByT5 glyph-text features


class ClipVisionOutput:
    """The image features as Wan (penultimate layer) and HunyuanVideo 1.5 (last layer) read them."""

    def __init__(self, hidden_states):
        self.penultimate_hidden_states = self.last_hidden_state = hidden_states


class RandomConditioning:
    """Seeded random text embeddings (and pooled output, CLIP vision features of `image_tokens` tokens of
    `image_dim` channels, `byt5_tokens` tokens of ByT5 glyph text, and with `text_mask` a text attention mask of
    ones, its last `padded_tokens` zero) in place of the encoders'."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {"default": 0}), "tokens": ("INT", {"default": 8}),
                             "dim": ("INT", {"default": 32}), "pooled_dim": ("INT", {"default": 0})},
                "optional": {"image_tokens": ("INT", {"default": 0}), "image_dim": ("INT", {"default": 1280}),
                             "byt5_tokens": ("INT", {"default": 0}), "text_mask": ("BOOLEAN", {"default": False}),
                             "padded_tokens": ("INT", {"default": 0})}}

    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "make"
    CATEGORY = "testing"

    def make(self, seed, tokens, dim, pooled_dim, image_tokens=0, image_dim=1280, byt5_tokens=0, text_mask=False,
             padded_tokens=0):
        g = torch.Generator().manual_seed(seed)
        extra = {"pooled_output": torch.randn(1, pooled_dim, generator=g)} if pooled_dim else {}
        text = torch.randn(1, tokens, dim, generator=g)
        if image_tokens:
            extra["clip_vision_output"] = ClipVisionOutput(torch.randn(1, image_tokens, image_dim, generator=g))
        if text_mask:  # LTX-Video's and HunyuanVideo's models take the mask as an argument of their own
            extra["attention_mask"] = torch.ones(1, tokens, dtype=torch.long)
            extra["attention_mask"][:, tokens - padded_tokens:] = 0
        if byt5_tokens:
            extra["conditioning_byt5small"] = torch.randn(1, byt5_tokens, BYT5_DIM, generator=g)
        return ([[text, extra]],)


class RecordModelCalls:
    """The MODEL, recording the inputs and output of every diffusion-model forward under RECORDS[key]."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "key": ("STRING", {"default": "calls"})}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "wrap"
    CATEGORY = "testing"

    def wrap(self, model, key):
        import comfy.patcher_extension

        calls = RECORDS.setdefault(key, [])

        def wrapper(executor, *args, **kwargs):
            out = executor(*args, **kwargs)
            calls.append({"args": [copied(a) for a in args if not isinstance(a, dict)], "out": copied(out)})
            return out

        patched = model.clone()
        patched.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, "tests", wrapper)
        return (patched,)


def copied(value):
    """A tensor, or a list or tuple of them (LTX-2's video and audio), cloned; anything else as it is."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (list, tuple)):
        return type(value)(copied(v) for v in value)
    return value


class AudioVideoLatent:
    """LTX-2's latent: the video LATENT and `audio_frames` frames of zero audio latent (8 channels x 16 frequency
    bins), packed as LTXVConcatAVLatent packs them."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"video": ("LATENT",), "audio_frames": ("INT", {"default": 4, "min": 1})}}

    RETURN_TYPES = ("LATENT",)
    FUNCTION = "pack"
    CATEGORY = "testing"

    def pack(self, video, audio_frames):
        import comfy.nested_tensor

        samples = video["samples"]
        audio = torch.zeros(samples.shape[0], 8, audio_frames, 16)
        return ({"samples": comfy.nested_tensor.NestedTensor((samples, audio))},)


class IsolateModalities:
    """The MODEL (LTX-2) with its audio-to-video and video-to-audio cross-attention off (ComfyUI's own
    `transformer_options` switches): the video's output no longer depends on the audio."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",)}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "isolate"
    CATEGORY = "testing"

    def isolate(self, model):
        patched = model.clone()
        options = patched.model_options.setdefault("transformer_options", {})
        options["a2v_cross_attn"] = options["v2a_cross_attn"] = False
        return (patched,)


class InterruptAfterCalls:
    """The MODEL, raising ComfyUI's interrupt (what the Cancel button does) at its `calls`-th diffusion-model
    forward, after the forwards before it ran."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "calls": ("INT", {"default": 2})}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "wrap"
    CATEGORY = "testing"

    def wrap(self, model, calls):
        import comfy.model_management
        import comfy.patcher_extension

        seen = [0]

        def wrapper(executor, *args, **kwargs):
            seen[0] += 1
            if seen[0] >= calls:
                raise comfy.model_management.InterruptProcessingException()
            return executor(*args, **kwargs)

        patched = model.clone()
        patched.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, "tests-interrupt", wrapper)
        return (patched,)


class KeepLatent:
    """Keeps the LATENT's samples (of an audio-video latent, the video's) under RECORDS[key] (an output node, so
    that the graph runs up to it)."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"samples": ("LATENT",), "key": ("STRING", {"default": "latent"})}}

    RETURN_TYPES = ()
    FUNCTION = "keep"
    OUTPUT_NODE = True
    CATEGORY = "testing"

    def keep(self, samples, key):
        latent = samples["samples"]
        RECORDS.setdefault(key, []).append(latent.tensors[0].clone() if getattr(latent, "is_nested", False)
                                           else latent.clone())
        return {}


NODES = {"RandomConditioning": RandomConditioning, "RecordModelCalls": RecordModelCalls, "KeepLatent": KeepLatent,
         "InterruptAfterCalls": InterruptAfterCalls, "AudioVideoLatent": AudioVideoLatent,
         "IsolateModalities": IsolateModalities}
