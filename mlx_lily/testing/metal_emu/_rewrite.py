"""Source-level rewrites that turn MSL text into C++ the shim can compile.

Two rewrites, both keeping every line where it was (so ``__LINE__`` and
compiler messages still point at the original body lines):

* ``threadgroup T name[N];`` declarations become references to a slot in the
  threadgroup's shared arena (``auto& name = __emu_tg_var<T[N], ID>(...)``).
  ``threadgroup`` elsewhere (pointer types, parameters) is an address-space
  qualifier and is left to the shim, which defines it away.
* ``1.0h`` half literals become ``((half)(1.0f))``.
"""

from __future__ import annotations

import itertools
import re

_TG_IDS = itertools.count(1)


def mask_code(text: str) -> str:
    """``text`` with comments and string/char literals blanked (same length, newlines kept)."""
    out = list(text)
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "/" and i + 1 < n and text[i + 1] == "/":
            j = text.find("\n", i)
            j = n if j < 0 else j
            for k in range(i, j):
                out[k] = " "
            i = j
        elif c == "/" and i + 1 < n and text[i + 1] == "*":
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            for k in range(i, j):
                if out[k] != "\n":
                    out[k] = " "
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            for k in range(i + 1, j - 1):
                out[k] = " "
            i = j
        else:
            i += 1
    return "".join(out)


_IDENT = re.compile(r"[A-Za-z_]\w*")


def _split_top(text: str, sep: str) -> list[tuple[int, int]]:
    """Spans of ``text`` split at ``sep`` outside (), [], {} and <>."""
    spans, depth, start = [], 0, 0
    for i, c in enumerate(text):
        if c in "([{<":
            depth += 1
        elif c in ")]}>":
            depth -= 1
        elif c == sep and depth == 0:
            spans.append((start, i))
            start = i + 1
    spans.append((start, len(text)))
    return spans


def _statement_start(masked: str, pos: int) -> bool:
    j = pos - 1
    while j >= 0 and masked[j] in " \t\r\n":
        j -= 1
    if j < 0:
        return True
    if masked[j] in ";{}":
        return True
    line_start = masked.rfind("\n", 0, j) + 1
    if masked[line_start : j + 1].lstrip().startswith("#"):
        return True  # right after a preprocessor line (#pragma, #define ...)
    if masked[j] == ":" and (j == 0 or masked[j - 1] != ":"):
        return True  # after a label / access specifier
    return False


def rewrite_threadgroup(text: str, mode: str = "emu", found: list | None = None) -> str:
    """Rewrite ``threadgroup`` variable declarations.

    ``mode="emu"``: into shared arena slots for the emulator.
    ``mode="lint"``: into ``static threadgroup`` declarations (clang rejects
    automatic variables in an address space), appending
    ``constexpr unsigned long __emu_tgsz_N = sizeof(name);`` so the lint can
    add up the threadgroup memory. ``found`` receives (name, brace depth, id).
    """
    masked = mask_code(text)
    pieces: list[str] = []
    last = 0
    for m in re.finditer(r"\bthreadgroup\b", masked):
        p = m.start()
        if p < last or not _statement_start(masked, p):
            continue
        end = masked.find(";", m.end())
        if end < 0:
            continue
        decl = masked[m.end() : end]
        if "=" in decl:
            continue  # threadgroup variables take no initializer: not a declaration we handle
        parts = _split_top(decl, ",")
        # Pointers, references and anything with parentheses keep the qualifier only.
        if any(any(c in decl[a:b].split("[", 1)[0] for c in "*&(") for a, b in parts):
            continue
        first = decl[parts[0][0] : parts[0][1]]
        bracket = first.find("[")
        name_zone = first if bracket < 0 else first[:bracket]
        idents = list(_IDENT.finditer(name_zone))
        if len(idents) < 2:
            continue
        name_m = idents[-1]
        type_text = " ".join(name_zone[: name_m.start()].split())
        decls = [(name_m.group(0), first[name_m.end() :].strip())]
        for a, b in parts[1:]:
            piece = decl[a:b]
            mm = _IDENT.search(piece)
            if not mm:
                break
            decls.append((mm.group(0), piece[mm.end() :].strip()))
        out = []
        depth = masked[:p].count("{") - masked[:p].count("}")
        for name, dims in decls:
            dims = " ".join(dims.split())
            ident = next(_TG_IDS)
            if found is not None:
                found.append((name, depth, ident))
            if mode == "lint":
                out.append(
                    f"static threadgroup {type_text} {name}{dims}; "
                    f"constexpr unsigned long __emu_tgsz_{ident} = sizeof({name});"
                )
            else:
                out.append(
                    f'auto& {name} = __emu_tg_var<{type_text} {dims}, {ident}>'
                    f'("{name}", __LINE__, __FILE__);'
                )
        original = text[p : end + 1]
        pieces.append(text[last:p])
        pieces.append(" ".join(out) + "\n" * original.count("\n"))
        last = end + 1
    pieces.append(text[last:])
    return "".join(pieces)


_HALF_LIT = re.compile(r"(?<![\w.])((?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?)[hH]\b")


def rewrite_half_literals(text: str) -> str:
    """``1.5h`` -> ``((half)(1.5f))`` (C++ has no half literal suffix)."""
    masked = mask_code(text)
    pieces, last = [], 0
    for m in _HALF_LIT.finditer(masked):
        lit = m.group(1)
        if "." not in lit and "e" not in lit.lower():
            lit += ".0"
        pieces.append(text[last : m.start()])
        pieces.append(f"((half)({lit}f))")
        last = m.end()
    pieces.append(text[last:])
    return "".join(pieces)


def to_cpp(text: str, mode: str = "emu", found: list | None = None) -> str:
    """Apply every rewrite."""
    return rewrite_half_literals(rewrite_threadgroup(text, mode, found))
