"""openpi's wire format, byte for byte, and the observation layouts robots send.

Frames are msgpack with openpi's numpy encoding (`openpi_client.msgpack_numpy`): an ndarray is a map
with **bin** keys ``{b"__ndarray__": True, b"data": C-order bytes, b"dtype": "<f4", b"shape": [...]}``,
a numpy scalar ``{b"__npgeneric__": True, b"data": item, b"dtype": ...}``; object, void and complex
dtypes are refused both ways. Decoding builds arrays from bytes and never runs code (no pickle).

    >>> unpackb(packb({"a": np.zeros((2, 3), np.float32)}))["a"].shape
    (2, 3)

Layouts map what a client sends onto the policy's own LeRobot keys (`observation.images.<camera>`,
`observation.state`, `task`): `lerobot` (the keys as they are), `libero` and `droid` (openpi's
example clients: ``observation/image``, ``observation/wrist_image``, ``observation/state``,
``prompt``, ...). A layout's camera entries are matched to the policy's cameras in order, unless a
mapping (`--map observation/image=observation.images.scene`) says otherwise. Images arrive HWC uint8
or CHW / HWC float in [0, 1], at any size; the processor resizes them as in training.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgpack
import numpy as np


class BadRequest(ValueError):
    """A request the server answers with a text frame naming the problem (the connection stays open)."""


def _pack_array(obj):
    if isinstance(obj, (np.ndarray, np.generic)) and obj.dtype.kind in "VOc":
        raise ValueError(f"unsupported dtype {obj.dtype} (object, void and complex arrays are not sent)")
    if isinstance(obj, np.ndarray):
        return {b"__ndarray__": True, b"data": np.ascontiguousarray(obj).tobytes(), b"dtype": obj.dtype.str,
                b"shape": list(obj.shape)}
    if isinstance(obj, np.generic):
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    return obj


NUMERIC_KINDS = "biuf"  # bool, signed and unsigned integers, floats: all a request's arrays may hold


def _dtype(obj: dict, what: str) -> np.dtype:
    try:
        dtype = np.dtype(obj[b"dtype"])
    except (KeyError, TypeError, ValueError):
        raise BadRequest(f"{what} without a valid dtype") from None
    if dtype.kind not in NUMERIC_KINDS:
        raise BadRequest(f"unsupported dtype {dtype} in {what} (numbers and booleans only)")
    return dtype


def _unpack_array(obj: dict):
    if b"__ndarray__" in obj:
        dtype = _dtype(obj, "an array")
        shape, data = obj.get(b"shape"), obj.get(b"data")
        if not isinstance(shape, (list, tuple)) or not all(isinstance(d, int) and d >= 0 for d in shape) \
                or not isinstance(data, bytes):
            raise BadRequest("an array needs bytes 'data' and a 'shape' of non-negative integers")
        if len(data) != int(np.prod(shape, dtype=object)) * dtype.itemsize:
            raise BadRequest(f"an array of shape {list(shape)} {dtype} does not match its {len(data)} data bytes")
        return np.ndarray(buffer=data, dtype=dtype, shape=tuple(shape))
    if b"__npgeneric__" in obj:
        dtype = _dtype(obj, "a scalar")
        try:
            return dtype.type(obj.get(b"data"))
        except (TypeError, ValueError, OverflowError) as e:
            raise BadRequest(f"a {dtype} scalar: {e}") from None
    return obj


def packb(obj) -> bytes:
    return msgpack.packb(obj, default=_pack_array, use_bin_type=True)


def unpackb(data: bytes):
    """A frame -> Python objects; a frame that is not valid msgpack raises BadRequest."""
    try:
        return msgpack.unpackb(data, object_hook=_unpack_array, raw=False, strict_map_key=False)
    except BadRequest:
        raise
    except msgpack.StackError:
        raise BadRequest("not a msgpack frame: nested too deeply") from None
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError) as e:
        raise BadRequest(f"not a msgpack frame: {e or type(e).__name__}") from None


# -- observation layouts -------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """Which request keys hold the cameras (in the policy's camera order), the state parts
    (concatenated in order) and the prompt."""

    name: str
    cameras: tuple[str, ...] = ()
    state: tuple[str, ...] = ()
    prompt: str = "prompt"


LAYOUTS = {
    "libero": Layout("libero", cameras=("observation/image", "observation/wrist_image"),
                     state=("observation/state",)),
    "droid": Layout("droid", cameras=("observation/exterior_image_1_left", "observation/wrist_image_left"),
                    state=("observation/joint_position", "observation/gripper_position")),
}


@dataclass
class PolicyInputs:
    """What the policy reads, for mapping requests: its cameras (LeRobot keys), its state keys and
    their widths, and the default prompt."""

    cameras: list[str]
    state_keys: list[str]
    state_widths: list[int]
    default_prompt: str = ""
    mapping: dict[str, str] = field(default_factory=dict)  # request key -> policy key, overriding a layout


def detect_layout(obs: dict) -> str:
    """'lerobot' when the request carries the policy's own keys, else the first layout whose keys it has."""
    if any(k.startswith("observation.") for k in obs):
        return "lerobot"
    for name, layout in LAYOUTS.items():
        if any(k in obs for k in (*layout.cameras, *layout.state)):
            return name
    return "lerobot"


def as_hwc_uint8(image, key: str) -> np.ndarray:
    """HWC uint8, or CHW / HWC float in [0, 1] -> HWC uint8."""
    a = image if isinstance(image, np.ndarray) else None
    if a is None or a.ndim != 3 or 3 not in (a.shape[0], a.shape[-1]) or min(a.shape) < 1:
        raise BadRequest(f"{key}: an image must be an (H, W, 3) or (3, H, W) array, got "
                         f"{list(a.shape) if a is not None else type(image).__name__}")
    if a.shape[-1] != 3:
        a = a.transpose(1, 2, 0)
    if a.dtype == np.uint8:
        return np.ascontiguousarray(a)
    if not np.issubdtype(a.dtype, np.floating):
        raise BadRequest(f"{key}: images must be uint8 or float in [0, 1], got {a.dtype}")
    if not np.isfinite(a).all():
        raise BadRequest(f"{key}: the image holds NaN or inf")
    # A float image on the 0-255 scale would otherwise be scaled again and clipped to white: refuse it.
    low, high = float(a.min()), float(a.max())
    if low < 0.0 or high > 1.0:
        raise BadRequest(f"{key}: a float image must hold values in [0, 1], got [{_shown(a.min())}, {_shown(a.max())}] "
                         "(send uint8 for 0-255 pixels)")
    return np.round(a.astype(np.float32) * 255.0).astype(np.uint8)


def _shown(value: np.floating) -> str:
    """A pixel value as short as `%g` unless that hides why it was refused: 200 -> '200', but
    float32 1.0000001 -> '1.0000001' (not '1')."""
    short = f"{float(value):g}"
    return short if float(short) == float(value) else str(value)


def to_policy_observation(obs: dict, inputs: PolicyInputs, layout: str | None = None) -> dict:
    """One request's observation -> the policy's keys: images (H, W, 3) uint8, state (D,) float32, task.

    Raises BadRequest naming the missing or misshapen key."""
    if not isinstance(obs, dict):
        raise BadRequest(f"a request must be a map of observation keys, got {type(obs).__name__}")
    if not all(isinstance(k, str) for k in obs):
        raise BadRequest(f"observation keys must be strings, got {[k for k in obs if not isinstance(k, str)][:3]}")
    name = layout or detect_layout(obs)
    if name not in ("lerobot", *LAYOUTS):
        raise BadRequest(f"unknown observation layout {name!r}; known: lerobot, {', '.join(LAYOUTS)}")
    source = _policy_keys(obs, inputs, name)
    out: dict = {}
    for camera in inputs.cameras:
        if camera not in source:
            raise BadRequest(f"missing image {camera!r} ({_wanted(inputs, name, camera)})")
        out[camera] = as_hwc_uint8(source[camera], camera)
    for key, width in zip(inputs.state_keys, inputs.state_widths):
        if key not in source:
            raise BadRequest(f"missing state {key!r} ({_wanted(inputs, name, key)})")
        value = _numbers(source[key], key)
        if value.ndim > 1 or value.size != width:
            raise BadRequest(f"{key}: the policy reads {width} values, got shape {list(value.shape)}")
        value = value.reshape(-1).astype(np.float64)
        if not np.isfinite(value).all():
            raise BadRequest(f"{key}: holds NaN or inf")
        out[key] = value.astype(np.float32)
    task = source.get("task", inputs.default_prompt)
    if isinstance(task, bytes):
        task = task.decode("utf-8", "replace")
    if not isinstance(task, str):
        raise BadRequest(f"the prompt must be a string, got {type(task).__name__}")
    out["task"] = task
    return out


def _policy_keys(obs: dict, inputs: PolicyInputs, name: str) -> dict:
    """Rename the request's keys to the policy's (the mapping first, then the layout)."""
    source = {inputs.mapping.get(k, k): v for k, v in obs.items()}
    if name == "lerobot":
        return source
    layout = LAYOUTS[name]
    for req, camera in zip(layout.cameras, inputs.cameras):
        if req in source and req not in inputs.mapping:
            source[camera] = source.pop(req)
    parts = [_numbers(source[k], k).reshape(-1) for k in layout.state if k in source]
    if parts and len(parts) == len(layout.state) and len(inputs.state_keys) == 1 \
            and inputs.state_keys[0] not in source:
        source[inputs.state_keys[0]] = np.concatenate(parts)
    if layout.prompt in source and "task" not in source:
        source["task"] = source.pop(layout.prompt)
    return source


def _numbers(value, key: str) -> np.ndarray:
    """A state value (array, list or number) as a numeric array, or BadRequest naming the key."""
    try:
        a = np.asarray(value)
    except (ValueError, TypeError):
        a = None
    if a is None or a.dtype.kind not in NUMERIC_KINDS:
        raise BadRequest(f"{key}: must be numbers, got {type(value).__name__}"
                         + (f" of {a.dtype}" if a is not None else ""))
    return a


def _wanted(inputs: PolicyInputs, name: str, key: str) -> str:
    if name == "lerobot":
        return "send the policy's own key"
    layout = LAYOUTS[name]
    if key in inputs.cameras:
        i = inputs.cameras.index(key)
        return f"the {name} layout sends it as {layout.cameras[i]!r}" if i < len(layout.cameras) else \
            f"the {name} layout has no camera for it: map one with --map KEY={key}"
    return f"the {name} layout sends it as {' + '.join(map(repr, layout.state))}"
