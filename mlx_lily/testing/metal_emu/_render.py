"""Render a custom kernel's Metal source the way MLX 0.32 does.

``mx.fast.metal_kernel`` writes the kernel signature itself: inputs in order
(``const device T*``, or ``const constant T*`` for fewer than 8 elements, or
``const constant T&`` for 0-d arrays), ``x_shape``/``x_strides``/``x_ndim``
right after their input when the text occurs in the source, then the outputs,
then every Metal attribute whose name occurs in the source (substring match,
in MLX's fixed order). Template arguments become C++ template parameters and
an explicit instantiation with a ``host_name``. This module reproduces that
text so that ``verbose=True`` prints what MLX would print and the emulator
compiles the very same declarations.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx

MAX_CONSTANT_ARRAY_SIZE = 8

# (name, MSL type) in the order MLX writes them (mlx/fast.cpp).
METAL_ATTRIBUTES: tuple[tuple[str, str], ...] = (
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
)

# The field of the runtime's __emu_attrs that feeds each attribute.
ATTRIBUTE_FIELDS = {name: name for name, _ in METAL_ATTRIBUTES}
ATTRIBUTE_FIELDS["grid_size"] = "threads_per_grid"

_TYPE_STRINGS = {
    mx.bool_: "bool",
    mx.uint8: "uint8_t",
    mx.uint16: "uint16_t",
    mx.uint32: "uint32_t",
    mx.uint64: "uint64_t",
    mx.int8: "int8_t",
    mx.int16: "int16_t",
    mx.int32: "int32_t",
    mx.int64: "int64_t",
    mx.float16: "float16_t",
    mx.bfloat16: "bfloat16_t",
    mx.float32: "float",
    mx.float64: "double",
    mx.complex64: "complex64_t",
}


def type_string(dtype: mx.Dtype) -> str:
    """The MSL type name MLX uses for ``dtype`` (``float16_t``, ``bfloat16_t``, ``uint32_t``...)."""
    try:
        return _TYPE_STRINGS[dtype]
    except KeyError:
        raise ValueError(f"[metal_kernel] unsupported dtype {dtype}") from None


@dataclass(frozen=True)
class InputInfo:
    """What the signature of one input depends on."""

    dtype: mx.Dtype
    ndim: int
    size: int


@dataclass(frozen=True)
class Param:
    """One parameter of the rendered kernel, in order."""

    kind: str  # "input", "scalar", "shape", "strides", "ndim", "output", "attribute"
    name: str
    ctype: str  # element type for buffers, attribute type for attributes
    index: int  # input/output index for buffers, -1 for attributes


def _template_kind(value) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, mx.Dtype):
        return "typename"
    raise ValueError(
        f"[metal_kernel] template argument {value!r} must be an int, bool or mlx Dtype"
    )


def template_value(value) -> str:
    """How MLX prints a template argument (bools as 1/0, dtypes by type name)."""
    kind = _template_kind(value)
    if kind == "bool":
        return "1" if value else "0"
    if kind == "int":
        return str(int(value))
    return type_string(value)


def write_template(template: Sequence[tuple[str, object]]) -> str:
    """``<float, 4, 1>``: the template argument list as MLX writes it."""
    return "<" + ", ".join(template_value(v) for _, v in template) + ">"


def kernel_name(
    name: str,
    template: Sequence[tuple[str, object]],
    inputs: Sequence[InputInfo],
    output_dtypes: Sequence[mx.Dtype],
) -> str:
    """The mangled ``custom_kernel_...`` name MLX gives an instantiation."""
    out = "custom_kernel_" + name
    if template:
        h = re.sub(r"<|>|(, )", "_", write_template(template))[:-1]
        out += "_" + h
    for info in inputs:
        out += "_" + type_string(info.dtype)
        if info.ndim == 0:
            out += "s"
        elif info.size < MAX_CONSTANT_ARRAY_SIZE:
            out += "c"
    for dt in output_dtypes:
        out += "_" + type_string(dt)
    return out


def shape_infos(source: str, input_names: Sequence[str]) -> list[tuple[bool, bool, bool]]:
    """Which of ``x_shape``, ``x_strides``, ``x_ndim`` occur in the source, per input."""
    return [
        (f"{n}_shape" in source, f"{n}_strides" in source, f"{n}_ndim" in source)
        for n in input_names
    ]


def attributes_used(source: str) -> list[tuple[str, str]]:
    """The Metal attributes MLX adds: every one whose name is a substring of the source."""
    return [(n, t) for n, t in METAL_ATTRIBUTES if n in source]


def parameters(
    source: str,
    input_names: Sequence[str],
    inputs: Sequence[InputInfo],
    output_names: Sequence[str],
    output_dtypes: Sequence[mx.Dtype],
) -> list[Param]:
    """The kernel parameters in MLX's order."""
    params: list[Param] = []
    infos = shape_infos(source, input_names)
    for i, (name, info) in enumerate(zip(input_names, inputs)):
        t = type_string(info.dtype)
        params.append(Param("scalar" if info.ndim == 0 else "input", name, t, i))
        if info.ndim > 0:
            has_shape, has_strides, has_ndim = infos[i]
            if has_shape:
                params.append(Param("shape", name + "_shape", "int", i))
            if has_strides:
                params.append(Param("strides", name + "_strides", "int64_t", i))
            if has_ndim:
                params.append(Param("ndim", name + "_ndim", "int", i))
    for i, (name, dt) in enumerate(zip(output_names, output_dtypes)):
        params.append(Param("output", name, type_string(dt), i))
    for name, t in attributes_used(source):
        params.append(Param("attribute", name, t, -1))
    return params


def write_signature(
    func_name: str,
    header: str,
    source: str,
    input_names: Sequence[str],
    inputs: Sequence[InputInfo],
    output_names: Sequence[str],
    output_dtypes: Sequence[mx.Dtype],
    template: Sequence[tuple[str, object]],
    atomic_outputs: bool,
    body: str | None = None,
    marks: dict | None = None,
) -> str:
    """The kernel source exactly as MLX's ``write_signature`` builds it.

    ``body`` replaces ``source`` in the output (the emulator passes a rewritten
    body with the same line structure); ``marks``, when given, receives the
    offsets where the header, signature and body start.
    """
    out = header
    if marks is not None:
        marks["signature"] = len(out)
    if template:
        out += "template <" + ", ".join(f"{_template_kind(v)} {n}" for n, v in template) + ">\n"
    out += "[[kernel]] void " + func_name + "(\n"
    infos = shape_infos(source, input_names)
    attrs = attributes_used(source)
    index = 0
    for i, (name, info) in enumerate(zip(input_names, inputs)):
        location = "constant" if info.size < MAX_CONSTANT_ARRAY_SIZE else "device"
        ref = "&" if info.ndim == 0 else "*"
        out += f"  const {location} {type_string(info.dtype)}{ref} {name} [[buffer({index})]],\n"
        index += 1
        if info.ndim > 0:
            has_shape, has_strides, has_ndim = infos[i]
            if has_shape:
                out += f"  const constant int* {name}_shape [[buffer({index})]],\n"
                index += 1
            if has_strides:
                out += f"  const constant int64_t* {name}_strides [[buffer({index})]],\n"
                index += 1
            if has_ndim:
                out += f"  const constant int& {name}_ndim [[buffer({index})]],\n"
                index += 1
    n_in, n_out = len(inputs), len(output_names)
    for name, dt in zip(output_names, output_dtypes):
        t = type_string(dt)
        if atomic_outputs:
            t = f"atomic<{t}>"
        out += f"  device {t}* {name} [[buffer({index})]]"
        # MLX's own (index-based) test for the last parameter, kept as is.
        if index < n_in + n_out - 1 or len(attrs) > 0:
            out += ",\n"
        else:
            out += ") {\n"
        index += 1
    for k, (name, t) in enumerate(attrs):
        out += f"  {t} {name} [[{name}]]"
        out += ",\n" if k < len(attrs) - 1 else ") {\n"
    if marks is not None:
        marks["body"] = len(out)
    out += source if body is None else body
    out += "\n}\n"
    return out


def render_msl(
    name: str,
    header: str,
    source: str,
    input_names: Sequence[str],
    inputs: Sequence[InputInfo],
    output_names: Sequence[str],
    output_dtypes: Sequence[mx.Dtype],
    template: Sequence[tuple[str, object]],
    atomic_outputs: bool,
) -> tuple[str, str]:
    """(mangled kernel name, full MSL source) as MLX generates them."""
    kname = kernel_name(name, template, inputs, output_dtypes)
    text = write_signature(
        kname, header, source, input_names, inputs, output_names, output_dtypes, template,
        atomic_outputs,
    )
    if template:
        tdef = kname + write_template(template)
        text += f'\ntemplate [[host_name("{kname}")]] [[kernel]] decltype({tdef}) {tdef};\n'
    return kname, text
