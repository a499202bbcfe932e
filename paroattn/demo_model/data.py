"""Procedural videos with captions: the training data of the demo model (`paro demo`).

Each video shows one or two textured shapes moving or rotating over a background (a soft gradient,
smooth clouds, or dots scattered at random), seen by a camera that may pan or zoom. No background
repeats itself: a periodic pattern would reward attending to far tokens of the same phase, which
natural video does not, and the point of this model is attention with the locality of real video.
Everything is drawn from a seed, so batch `i` of seed `s` is the same on every run
(`make_batch(seed, i, ...)`); the renderer is vectorized torch and runs on the GPU while training. Pixels are in [-1, 1], videos are [B, 3, frames, height, width].

A caption names what is in the video with words from `VOCABULARY`:
    "red circle moving left quickly and blue square rotating slowly, pan right, cloudy background"
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

COLORS = {
    "red": (1.00, 0.15, 0.15),
    "green": (0.20, 0.90, 0.20),
    "blue": (0.25, 0.35, 1.00),
    "yellow": (1.00, 0.90, 0.15),
    "cyan": (0.15, 0.90, 0.95),
    "magenta": (0.95, 0.20, 0.90),
    "white": (0.95, 0.95, 0.95),
    "orange": (1.00, 0.55, 0.10),
}
SHAPES = ("circle", "square", "triangle", "ring")
MOTIONS = ("left", "right", "up", "down", "rotating")  # the first four are "moving <direction>"
SPEEDS = ("slowly", "quickly")
CAMERAS = ("static", "pan left", "pan right", "pan up", "pan down", "zoom in", "zoom out")
BACKGROUNDS = ("plain", "cloudy", "dotted")

PAD = "<pad>"
VOCABULARY = (
    PAD, "and", "moving", "background", "pan", "zoom", "in", "out",
    *COLORS, *SHAPES, *MOTIONS, *SPEEDS, *BACKGROUNDS,
)
MAX_WORDS = 16

# motion in world units (the frame spans [-1, 1]) per frame, and rotation in radians per frame
_SPEED = (0.06, 0.13)
_SPIN = (0.22, 0.45)
_PAN_SPEED = 0.09
_ZOOM_RATE = 0.07
_DIRECTIONS = {"left": (-1.0, 0.0), "right": (1.0, 0.0), "up": (0.0, -1.0), "down": (0.0, 1.0)}
# backgrounds: waves summed into the clouds, and dots scattered over the world the camera can see
# (pans move the view by up to ~0.3 and zooming out widens it by ~1.3x, hence the +-1.8 square)
_CLOUD_WAVES = 5
_CLOUD_FREQ = (2.0, 5.0)  # radians per world unit: about 0.6 to 1.6 cycles across the frame
_DOTS = 20
_DOT_EXTENT = 1.8
_DOT_RADIUS = (0.08, 0.16)


@dataclass(frozen=True)
class VideoSpec:
    """The discrete content of a batch of videos (what the captions say), one entry per video."""

    num_objects: torch.Tensor  # [B] 1 or 2
    color: torch.Tensor  # [B, 2] index into COLORS
    shape: torch.Tensor  # [B, 2] index into SHAPES
    motion: torch.Tensor  # [B, 2] index into MOTIONS
    speed: torch.Tensor  # [B, 2] index into SPEEDS
    camera: torch.Tensor  # [B] index into CAMERAS
    background: torch.Tensor  # [B] index into BACKGROUNDS

    def captions(self) -> list[str]:
        colors = list(COLORS)
        out = []
        for b in range(self.num_objects.numel()):
            parts = []
            for j in range(int(self.num_objects[b])):
                motion = MOTIONS[int(self.motion[b, j])]
                verb = "rotating" if motion == "rotating" else f"moving {motion}"
                parts.append(
                    f"{colors[int(self.color[b, j])]} {SHAPES[int(self.shape[b, j])]} {verb} "
                    f"{SPEEDS[int(self.speed[b, j])]}"
                )
            caption = " and ".join(parts)
            camera = CAMERAS[int(self.camera[b])]
            if camera != "static":
                caption += f", {camera}"
            caption += f", {BACKGROUNDS[int(self.background[b])]} background"
            out.append(caption)
        return out


def sample_spec(batch: int, generator: torch.Generator) -> VideoSpec:
    """Random discrete content; the second object never shares the first one's color."""
    g = generator
    first = torch.randint(len(COLORS), (batch,), generator=g)
    second = (first + 1 + torch.randint(len(COLORS) - 1, (batch,), generator=g)) % len(COLORS)
    return VideoSpec(
        num_objects=1 + torch.randint(2, (batch,), generator=g),
        color=torch.stack([first, second], dim=1),
        shape=torch.randint(len(SHAPES), (batch, 2), generator=g),
        motion=torch.randint(len(MOTIONS), (batch, 2), generator=g),
        speed=torch.randint(len(SPEEDS), (batch, 2), generator=g),
        camera=torch.randint(len(CAMERAS), (batch,), generator=g),
        background=torch.randint(len(BACKGROUNDS), (batch,), generator=g),
    )


def parse_caption(caption: str) -> VideoSpec:
    """The spec a caption describes (inverse of `VideoSpec.captions`), for rendering a prompt's
    ground truth. Raises ValueError naming the caption grammar when the caption does not fit it."""
    grammar = (
        "expected '<color> <shape> (moving <left|right|up|down>|rotating) <slowly|quickly>"
        "[ and <second object>][, pan <direction>|, zoom <in|out>], <plain|cloudy|dotted> background'"
    )
    pieces = [p.strip() for p in caption.split(",")]
    objects = [o.split() for o in pieces[0].split(" and ")]
    camera, background = "static", None
    for piece in pieces[1:]:
        words = piece.split()
        if len(words) == 2 and words[1] == "background" and words[0] in BACKGROUNDS:
            background = words[0]
        elif piece in CAMERAS:
            camera = piece
        else:
            raise ValueError(f"caption {caption!r}: cannot read {piece!r}; {grammar}")
    if background is None or not 1 <= len(objects) <= 2:
        raise ValueError(f"caption {caption!r}: {grammar}")
    color, shape, motion, speed = [[0, 0] for _ in range(4)]
    for j, words in enumerate(objects):
        if words[2:3] == ["moving"]:
            words = words[:2] + words[3:]
        if len(words) != 4 or words[0] not in COLORS or words[1] not in SHAPES or words[2] not in MOTIONS \
                or words[3] not in SPEEDS:
            raise ValueError(f"caption {caption!r}: cannot read object {' '.join(words)!r}; {grammar}")
        color[j], shape[j] = list(COLORS).index(words[0]), SHAPES.index(words[1])
        motion[j], speed[j] = MOTIONS.index(words[2]), SPEEDS.index(words[3])
    return VideoSpec(
        num_objects=torch.tensor([len(objects)]),
        color=torch.tensor([color]), shape=torch.tensor([shape]),
        motion=torch.tensor([motion]), speed=torch.tensor([speed]),
        camera=torch.tensor([CAMERAS.index(camera)]), background=torch.tensor([BACKGROUNDS.index(background)]),
    )


def render(spec: VideoSpec, generator: torch.Generator, frames: int = 8, height: int = 32, width: int = 32,
           device: torch.device | str = "cpu") -> torch.Tensor:
    """Draw the videos of `spec`; continuous details (positions, sizes, background colors and
    pattern frequencies, texture phases) come from `generator`. Returns [B, 3, F, H, W] in [-1, 1]."""
    g = generator
    B = spec.num_objects.numel()

    def uniform(*shape, low=0.0, high=1.0):
        return (low + (high - low) * torch.rand(*shape, generator=g)).to(device)

    # continuous parameters, drawn on the CPU generator so a seed means the same video everywhere
    bg_dark = uniform(B, 3, low=0.02, high=0.30)
    bg_light = bg_dark + uniform(B, 3, low=0.10, high=0.30)
    bg_angle = uniform(B, low=0.0, high=2 * math.pi)  # direction of the gradient
    wave_freq = uniform(B, _CLOUD_WAVES, low=_CLOUD_FREQ[0], high=_CLOUD_FREQ[1])
    wave_angle = uniform(B, _CLOUD_WAVES, low=0.0, high=2 * math.pi)
    wave_phase = uniform(B, _CLOUD_WAVES, low=0.0, high=2 * math.pi)
    dot_center = uniform(B, _DOTS, 2, low=-_DOT_EXTENT, high=_DOT_EXTENT)
    dot_radius = uniform(B, _DOTS, low=_DOT_RADIUS[0], high=_DOT_RADIUS[1])
    obj_mid = uniform(B, 2, 2, low=-0.35, high=0.35)  # object position at the middle frame
    obj_size = uniform(B, 2, low=0.26, high=0.40)
    obj_tilt = uniform(B, 2, low=-0.3, high=0.3)
    obj_spin_sign = torch.where(torch.rand(B, 2, generator=g) < 0.5, -1.0, 1.0).to(device)
    obj_tex_freq = uniform(B, 2, low=8.0, high=14.0)

    t = torch.arange(frames, device=device, dtype=torch.float32) - (frames - 1) / 2  # [F], 0 at the middle
    ys = (torch.arange(height, device=device, dtype=torch.float32) + 0.5) / height * 2 - 1
    xs = (torch.arange(width, device=device, dtype=torch.float32) + 0.5) / width * 2 - 1
    ys = ys.view(1, 1, height, 1)
    xs = xs.view(1, 1, 1, width)
    pixels_per_unit = width / 2

    # camera: world = center(t) + screen / zoom(t)
    camera = spec.camera.to(device)
    pan = torch.zeros(B, 2, device=device)
    for name, (dx, dy) in _DIRECTIONS.items():
        selected = camera == CAMERAS.index(f"pan {name}")
        pan[selected] = torch.tensor([dx, dy], device=device)
    zoom_sign = (camera == CAMERAS.index("zoom in")).float() - (camera == CAMERAS.index("zoom out")).float()
    zoom = torch.exp(zoom_sign.view(B, 1) * _ZOOM_RATE * t.view(1, frames)).view(B, frames, 1, 1)
    center_x = (pan[:, 0].view(B, 1) * _PAN_SPEED * t).view(B, frames, 1, 1)
    center_y = (pan[:, 1].view(B, 1) * _PAN_SPEED * t).view(B, frames, 1, 1)
    wx = center_x + xs / zoom  # [B, F, H, W]
    wy = center_y + ys / zoom

    # backgrounds in world coordinates, so they move with the camera
    gradient = torch.sigmoid(1.2 * (wx * torch.cos(bg_angle).view(B, 1, 1, 1) + wy * torch.sin(bg_angle).view(B, 1, 1, 1)))
    along = (wx.unsqueeze(1) * torch.cos(wave_angle).view(B, -1, 1, 1, 1)
             + wy.unsqueeze(1) * torch.sin(wave_angle).view(B, -1, 1, 1, 1))  # [B, waves, F, H, W]
    field = torch.cos(wave_freq.view(B, -1, 1, 1, 1) * along + wave_phase.view(B, -1, 1, 1, 1)).sum(1)
    clouds = torch.sigmoid(2.5 * field / math.sqrt(_CLOUD_WAVES))
    distance = torch.sqrt((wx.unsqueeze(1) - dot_center[:, :, 0].view(B, -1, 1, 1, 1)) ** 2
                          + (wy.unsqueeze(1) - dot_center[:, :, 1].view(B, -1, 1, 1, 1)) ** 2)  # [B, dots, F, H, W]
    coverage = (0.5 + (dot_radius.view(B, -1, 1, 1, 1) - distance) * zoom.unsqueeze(1) * pixels_per_unit).clamp(0.0, 1.0)
    dots = coverage.amax(dim=1)
    kind = spec.background.to(device).view(B, 1, 1, 1)
    mix = torch.where(kind == 0, gradient, torch.where(kind == 1, clouds, dots)).unsqueeze(1)  # [B, 1, F, H, W]
    video = bg_dark.view(B, 3, 1, 1, 1) + (bg_light - bg_dark).view(B, 3, 1, 1, 1) * mix

    palette = torch.tensor(list(COLORS.values()), device=device)
    for j in range(2):
        present = (spec.num_objects.to(device) > j).float().view(B, 1, 1, 1)
        motion = spec.motion[:, j].to(device)
        speed = spec.speed[:, j].to(device)
        direction = torch.zeros(B, 2, device=device)
        for name, (dx, dy) in _DIRECTIONS.items():
            direction[motion == MOTIONS.index(name)] = torch.tensor([dx, dy], device=device)
        step = torch.tensor(_SPEED, device=device)[speed]
        spin = torch.tensor(_SPIN, device=device)[speed] * obj_spin_sign[:, j]
        rotating = (motion == MOTIONS.index("rotating")).float()
        ox = (obj_mid[:, j, 0].view(B, 1) + direction[:, 0].view(B, 1) * step.view(B, 1) * t).view(B, frames, 1, 1)
        oy = (obj_mid[:, j, 1].view(B, 1) + direction[:, 1].view(B, 1) * step.view(B, 1) * t).view(B, frames, 1, 1)
        theta = (obj_tilt[:, j].view(B, 1) + (rotating * spin).view(B, 1) * t).view(B, frames, 1, 1)
        size = obj_size[:, j].view(B, 1, 1, 1)
        dx, dy = wx - ox, wy - oy
        lx = (dx * torch.cos(theta) + dy * torch.sin(theta)) / size
        ly = (-dx * torch.sin(theta) + dy * torch.cos(theta)) / size
        radius = torch.sqrt(lx * lx + ly * ly + 1e-12)
        shape = spec.shape[:, j].to(device).view(B, 1, 1, 1)
        sdf = torch.where(
            shape == 0, radius - 1.0,
            torch.where(
                shape == 1, torch.maximum(lx.abs(), ly.abs()) - 0.85,
                torch.where(
                    shape == 2, torch.maximum(lx.abs() * 0.866 - ly * 0.5, ly) - 0.45,
                    (radius - 0.72).abs() - 0.28,
                ),
            ),
        )
        # signed distance in pixels -> coverage, i.e. one pixel of antialiasing
        alpha = (0.5 - sdf * size * zoom * pixels_per_unit).clamp(0.0, 1.0) * present
        shade = 0.78 + 0.22 * torch.sin(obj_tex_freq[:, j].view(B, 1, 1, 1) * lx * size)
        color = palette[spec.color[:, j].to(device)].view(B, 3, 1, 1, 1) * shade.unsqueeze(1)
        video = video * (1 - alpha.unsqueeze(1)) + color * alpha.unsqueeze(1)
    return video.clamp(0.0, 1.0) * 2 - 1


def color_centroids(video: torch.Tensor, color: str, tolerance: float = 0.5) -> torch.Tensor:
    """Per frame, the (x, y) pixel centroid of the pixels within `tolerance` of `color` in every
    channel: [F, 2], NaN in frames without such pixels. `video` is [3, F, H, W] in [-1, 1]. How
    the tests and `scripts/demo_model_samples.py` follow an object of a known color."""
    target = torch.tensor(COLORS[color], dtype=video.dtype).view(3, 1, 1, 1) * 2 - 1
    near = ((video - target).abs().amax(dim=0) < tolerance).float()  # [F, H, W]
    count = near.sum(dim=(1, 2))
    xs = torch.arange(video.shape[-1], dtype=video.dtype)
    ys = torch.arange(video.shape[-2], dtype=video.dtype)
    x = (near.sum(dim=1) * xs).sum(dim=-1) / count
    y = (near.sum(dim=2) * ys).sum(dim=-1) / count
    return torch.stack([x, y], dim=1)


def batch_generator(seed: int, index: int) -> torch.Generator:
    """The generator of batch `index` of a run seeded with `seed`: batches are independent of each
    other, so a resumed run draws exactly what an uninterrupted one would have."""
    return torch.Generator().manual_seed((seed * 1_000_003 + index) % (2**63))


def make_batch(seed: int, index: int, batch: int, frames: int = 8, height: int = 32, width: int = 32,
               device: torch.device | str = "cpu") -> tuple[torch.Tensor, list[str]]:
    """Batch `index` of the dataset of `seed`: (videos [B, 3, F, H, W] in [-1, 1], captions)."""
    g = batch_generator(seed, index)
    spec = sample_spec(batch, g)
    return render(spec, g, frames, height, width, device), spec.captions()


# prompts of the demo model's calibration and of its quality study (QUALITY.md)
CALIBRATION_PROMPTS = [
    "red circle moving right quickly and green square rotating slowly, pan left, cloudy background",
    "white ring moving up slowly and blue triangle moving left quickly, zoom in, plain background",
]
# more calibration prompts, for measuring what more of them buys (QUALITY.md); none is an evaluation prompt
MORE_CALIBRATION_PROMPTS = [
    "blue square moving down quickly, pan right, dotted background",
    "orange ring rotating slowly and white circle moving left slowly, cloudy background",
    "cyan triangle moving up quickly, zoom out, cloudy background",
    "magenta square moving left slowly and yellow triangle rotating quickly, pan down, plain background",
    "green ring moving right slowly, zoom in, dotted background",
    "red triangle rotating quickly and cyan circle moving up slowly, plain background",
]
# the fixed evaluation set of QUALITY.md, held out from calibration; the demo uses the first --num-prompts
EVAL_PROMPTS = [
    "yellow square moving right slowly, pan up, dotted background",
    "magenta circle rotating quickly and cyan ring moving down slowly, cloudy background",
    "orange triangle moving left quickly, zoom out, plain background",
    "green circle moving up quickly and red square moving right slowly, pan right, dotted background",
    "white triangle moving down slowly, pan left, cloudy background",
    "blue ring moving right quickly and orange square moving up slowly, zoom in, dotted background",
    "red square rotating slowly, pan down, plain background",
    "cyan circle moving left slowly and magenta triangle moving down quickly, cloudy background",
]
