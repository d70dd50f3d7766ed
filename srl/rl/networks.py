"""The networks seam: the encoder that turns an observation into features, chosen from the observation.

Owns: ``EncoderConfig`` (which encoder; an algorithm's Config embeds it as ``encoder``), the encoders
(``mlp``: the config's ``hidden_block`` over a float vector; ``nature_cnn``: the DQN network of Mnih et
al. 2015, three convolutions and 512 units, for images of 36x36 and up; ``minatar_cnn``: one 16-filter
3x3 convolution and 128 units, the network of the MinAtar paper (Young & Tian 2019), for small grids;
``impala_cnn``: the 15-layer residual network of IMPALA (Espeholt et al. 2018), 256 units) and a
user's own ``module:callable``. DQN (its dueling head on top), PPO and IMPALA build theirs here.
Must never: import a module named by a config unless the caller allowed it (a node checks
``imported_modules`` against what it allows before it builds anything), or unpickle anything.

An image encoder takes observations as the env gives them (uint8 0..255 or bool, channels first or
last) and does the rest inside the network: the cast to float, the scaling of uint8 to [0, 1] and the
move of channels first. Rows stay one byte per pixel on the wire and in replay.

``auto`` (the default) picks ``mlp`` for vectors, ``nature_cnn`` for images of 36x36 and up, and
``minatar_cnn`` below that. A ``module:callable`` is called with the ``EnvSpec`` and returns a
``torch.nn.Module`` that maps a batch of observations (as the env gives them) to ``(batch, features)``.
"""

from __future__ import annotations

import difflib
import importlib
import math
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch
from torch import nn

from srl.base.config import Settings
from srl.base.env import EnvSpec
from srl.rl.blocks import MLPBlockConfig

ENCODERS = ("auto", "mlp", "nature_cnn", "minatar_cnn", "impala_cnn")
"""the encoders srl builds itself (a ``module:callable`` names another)"""
NATURE_MIN_SIZE = 36
"""the smallest image side the Nature CNN takes (8x8 stride 4, 4x4 stride 2, 3x3 leave 1x1 at 36)"""
MAX_ENCODER_WEIGHTS = 100_000_000
"""weights an encoder may have (400 MB of float32): a config may come from a board"""
_FACTORY = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_.]*")


class EncoderError(ValueError):
    """The encoder cannot be built for this observation as asked."""


@dataclass
class EncoderConfig(Settings):
    """Which network turns observations into features (see the module docstring)."""

    kind: str = "auto"
    """"auto", "mlp", "nature_cnn", "minatar_cnn", "impala_cnn", or "package.module:factory" (imported
    only where allowed: a node's --allow-env-modules)"""
    channels_last: bool | None = None
    """whether an image's channels are its last axis (H, W, C); None: when the last axis is shorter than
    the first (84x84x4 is channels last, 4x84x84 first)"""

    def validate(self) -> None:
        if not isinstance(self.kind, str) or (self.kind not in ENCODERS and not _FACTORY.fullmatch(self.kind)):
            close = difflib.get_close_matches(str(self.kind)[:64], ENCODERS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"encoder.kind must be one of {list(ENCODERS)} or 'package.module:factory', got "
                             f"{str(self.kind)[:60]!r}{hint}")
        if self.channels_last is not None and not isinstance(self.channels_last, bool):
            raise ValueError(f"encoder.channels_last must be true, false or null, got {str(self.channels_last)[:40]}")

    def imported_module(self) -> str | None:
        """The module a ``module:callable`` kind imports (None for srl's own encoders)."""
        return self.kind.partition(":")[0] if ":" in self.kind else None

    def resolved_kind(self, spec: EnvSpec) -> str:
        """The encoder ``spec``'s observations get."""
        if self.kind != "auto":
            return self.kind
        if not spec.image:
            return "mlp"
        return "minatar_cnn" if self.small_image(spec) else "nature_cnn"

    def small_image(self, spec: EnvSpec) -> bool:
        """Whether ``spec`` observes images with a side under the Nature CNN's smallest (MinAtar's 10x10 grids)."""
        return spec.image and min(image_size(spec, self._channels_last(spec))) < NATURE_MIN_SIZE

    def _channels_last(self, spec: EnvSpec) -> bool:
        shape = spec.obs_shape
        if len(shape) != 3:
            return False
        return self.channels_last if self.channels_last is not None else shape[-1] < shape[0]

    def check(self, spec: EnvSpec) -> str:
        """The encoder kind ``spec`` gets; EncoderError when srl's own encoder of that kind cannot take its
        observations (an MLP on images, a CNN on vectors, the Nature CNN on small images)."""
        self.validate()
        kind = self.resolved_kind(spec)
        if kind == "mlp" and spec.image:
            raise EncoderError(f"encoder 'mlp' takes vector observations; {spec.env_id!r} observes "
                               f"{spec.obs_dtype} images {spec.obs_shape}: use a CNN encoder (or 'auto')")
        if kind in CNN_BUILDERS:
            if not spec.image:
                raise EncoderError(f"encoder {kind!r} takes images; {spec.env_id!r} observes float vectors "
                                   f"{spec.obs_shape}: use 'mlp' (or 'auto')")
            height, width = image_size(spec, self._channels_last(spec))
            smallest = NATURE_MIN_SIZE if kind == "nature_cnn" else 3
            if min(height, width) < smallest:
                raise EncoderError(f"encoder {kind!r} takes images of {smallest}x{smallest} and up; "
                                   f"{spec.env_id!r} observes {height}x{width}: use 'minatar_cnn' (or 'auto')")
        return kind

    def build(self, spec: EnvSpec, mlp: MLPBlockConfig, allow_modules: Collection[str] | None = None
              ) -> tuple[nn.Module, int]:
        """The encoder for ``spec`` and its number of output features. ``mlp``: the layers of the ``mlp``
        encoder (the algorithm's ``hidden_block``). ``allow_modules``: the modules a ``module:callable``
        may import (None: any; a user's own process)."""
        kind = self.check(spec)
        if kind == "mlp":
            return mlp.build(spec.obs_shape[0])
        if kind in CNN_BUILDERS:
            channels_last = self._channels_last(spec)
            channels = spec.obs_shape[-1 if channels_last else 0] if len(spec.obs_shape) == 3 else 1
            height, width = image_size(spec, channels_last)
            body, features = CNN_BUILDERS[kind](channels, height, width)
            return nn.Sequential(ImageInput(spec.obs_dtype, len(spec.obs_shape), channels_last), body), features
        return _user_encoder(self.kind, spec, allow_modules)


def image_size(spec: EnvSpec, channels_last: bool) -> tuple[int, int]:
    shape = spec.obs_shape
    if len(shape) == 2:
        return shape[0], shape[1]
    return (shape[0], shape[1]) if channels_last else (shape[1], shape[2])


class ImageInput(nn.Module):
    """Images as the env gives them -> float ``(B, C, H, W)``: uint8 scaled to [0, 1], bool to {0, 1}."""

    def __init__(self, dtype: str, ndim: int, channels_last: bool) -> None:
        super().__init__()
        self.scale = 1.0 / 255.0 if dtype == "uint8" else 1.0
        self.ndim = ndim
        self.channels_last = channels_last

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        x = obs.to(torch.float32)
        if self.scale != 1.0:
            x = x * self.scale
        if self.ndim == 2:
            return x.unsqueeze(1)
        return x.permute(0, 3, 1, 2) if self.channels_last else x


def nature_cnn(channels: int, height: int, width: int) -> tuple[nn.Module, int]:
    convs = nn.Sequential(
        nn.Conv2d(channels, 32, 8, stride=4), nn.ReLU(),
        nn.Conv2d(32, 64, 4, stride=2), nn.ReLU(),
        nn.Conv2d(64, 64, 3, stride=1), nn.ReLU(),
        nn.Flatten(),
    )
    size = _flat_size(convs, channels, height, width)
    return nn.Sequential(convs, nn.Linear(size, 512), nn.ReLU()), 512


def minatar_cnn(channels: int, height: int, width: int) -> tuple[nn.Module, int]:
    convs = nn.Sequential(nn.Conv2d(channels, 16, 3, stride=1), nn.ReLU(), nn.Flatten())
    size = _flat_size(convs, channels, height, width)
    return nn.Sequential(convs, nn.Linear(size, 128), nn.ReLU()), 128


class _Residual(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv0 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv1(torch.relu(self.conv0(torch.relu(x))))


def impala_cnn(channels: int, height: int, width: int) -> tuple[nn.Module, int]:
    layers: list[nn.Module] = []
    size = channels
    for depth in (16, 32, 32):
        layers += [nn.Conv2d(size, depth, 3, padding=1), nn.MaxPool2d(3, stride=2, padding=1),
                   _Residual(depth), _Residual(depth)]
        size = depth
    convs = nn.Sequential(*layers, nn.ReLU(), nn.Flatten())
    flat = _flat_size(convs, channels, height, width)
    return nn.Sequential(convs, nn.Linear(flat, 256), nn.ReLU()), 256


CNN_BUILDERS: dict[str, Callable[[int, int, int], tuple[nn.Module, int]]] = {
    "nature_cnn": nature_cnn, "minatar_cnn": minatar_cnn, "impala_cnn": impala_cnn}


def _flat_size(convs: nn.Module, channels: int, height: int, width: int) -> int:
    if channels * height * width > 16 * 2**20:
        raise EncoderError(f"an image of {channels}x{height}x{width} is beyond what srl's CNNs take")
    with torch.no_grad():
        return int(convs(torch.zeros(1, channels, height, width)).shape[1])


def _user_encoder(kind: str, spec: EnvSpec, allow_modules: Collection[str] | None) -> tuple[nn.Module, int]:
    module_name, _, attr = kind.partition(":")
    check_module_allowed(module_name, allow_modules)
    try:
        factory = importlib.import_module(module_name)
        for part in attr.split("."):
            factory = getattr(factory, part)
    except (ImportError, AttributeError) as e:
        raise EncoderError(f"encoder {kind!r}: cannot find {attr!r} in {module_name!r}: {e}") from e
    if not callable(factory):
        raise EncoderError(f"encoder {kind!r} is not callable")
    module = factory(spec)
    if not isinstance(module, nn.Module):
        raise EncoderError(f"encoder {kind!r} returned a {type(module).__name__}, not a torch.nn.Module")
    weights = sum(p.numel() for p in module.parameters())
    if weights > MAX_ENCODER_WEIGHTS:
        raise EncoderError(f"encoder {kind!r} has {weights:,} weights; at most {MAX_ENCODER_WEIGHTS:,} are allowed")
    with torch.no_grad():
        out = module(torch.zeros((1, *spec.obs_shape), dtype=getattr(torch, spec.obs_dtype)))
    if not isinstance(out, torch.Tensor) or out.ndim != 2 or out.shape[0] != 1:
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise EncoderError(f"encoder {kind!r} must map a batch of observations to (batch, features); one "
                           f"observation gave {shape}")
    return module, int(out.shape[1])


def check_module_allowed(module: str, allow_modules: Collection[str] | None) -> None:
    """Refuse to import ``module`` unless ``allow_modules`` (None: no restriction) names it or a parent."""
    if allow_modules is None or any(module == m or module.startswith(m + ".") for m in allow_modules):
        return
    raise EncoderError(
        f"the task's encoder would import the module {module!r}, which this node does not allow; start the "
        f"node with --allow-env-modules {module} (or SRL_ALLOW_ENV_MODULES={module}) if you trust it")


def orthogonal_init(module: nn.Module, gain: float = math.sqrt(2)) -> None:
    """Orthogonal weights and zero biases for every convolution and linear layer (CleanRL's layer_init)."""
    for layer in module.modules():
        if isinstance(layer, (nn.Conv2d, nn.Linear)):
            nn.init.orthogonal_(layer.weight, gain)
            if layer.bias is not None:
                nn.init.constant_(layer.bias, 0.0)
