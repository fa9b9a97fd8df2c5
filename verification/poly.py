"""Polynomial commitments over GF(65497), vectorised over many chunks at once.

A chunk's top-k points (index, bf16 bits) are committed as the unique polynomial of degree < k
through (index mod m, bits) over GF(65497), where m is the largest modulus <= 65497 that keeps the
chunk's indices distinct. Since the interpolating polynomial is unique, these coefficients equal
the `toploc` package's (which expands Newton divided differences one chunk at a time in C++); we
run the same Newton scheme as numpy array operations over all chunks together, so the cost per
chunk falls as chunks are batched.
Invariant: `evaluate(interpolate(x, y), x) == y mod P` for every row.
"""

from __future__ import annotations

import numpy as np
import torch

P = 65497
"""The prime field (largest prime below 2**16 - 38: bf16 bit patterns of finite values stay below it)."""

# x^(P-2) = x^-1 in GF(P); a table, since every difference of two residues lies in [1, P).
_INV = np.ones(P, dtype=np.int64)


def _build_inverse_table() -> None:
    base = np.arange(P, dtype=np.int64)
    result = np.ones(P, dtype=np.int64)
    e = P - 2
    while e:
        if e & 1:
            result = result * base % P
        base = base * base % P
        e >>= 1
    _INV[:] = result
    _INV[0] = 0


_build_inverse_table()


def injective_modulus(indices: np.ndarray, start: int = P) -> int:
    """Largest m <= start with all `indices % m` distinct (toploc's rule)."""
    x = np.asarray(indices, dtype=np.int64)
    if len(np.unique(x)) != len(x):
        raise ValueError("indices are not distinct")
    if int(x.max(initial=0)) < start:
        return start
    for lo in range(start, 0, -64):
        ms = np.arange(lo, max(lo - 64, 0), -1, dtype=np.int64)
        r = np.sort(x[None, :] % ms[:, None], axis=1)
        ok = ~(r[:, 1:] == r[:, :-1]).any(axis=1)
        if ok.any():
            return int(ms[int(np.argmax(ok))])
    raise ValueError("no injective modulus")  # unreachable for distinct indices


_INV_P = 1.0 / P


def _reduce(v: np.ndarray) -> np.ndarray:
    """v mod P, up to one multiple of P (result in (-P, 2P)), for float64 integers |v| < 2**52.

    Float64 multiply-and-floor is ~2x faster than int64 `%` in numpy. Every product formed here
    stays below 4 P**2 < 2**35, so all values remain exact integers; the loose range is folded by
    one exact integer `%` at the end."""
    return v - np.floor(v * _INV_P) * P


def interpolate(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Coefficients [C, n] (ascending powers) of the polynomials through rows of x, y [C, n] in GF(P).

    Each row of x must hold distinct residues in [0, P)."""
    xi = np.asarray(x, dtype=np.int64) % P
    xf = xi.astype(np.float64)
    dd = (np.asarray(y, dtype=np.int64) % P).astype(np.float64)
    c, n = xf.shape
    # Newton divided differences, in place: after step k, dd[:, i] = f[x_{i-k} .. x_i] for i >= k.
    for k in range(1, n):
        # differences lie in (-P, P); a negative index d reads _INV[P + d], the inverse of d mod P
        dd[:, k:] = _reduce((dd[:, k:] - dd[:, k - 1 : n - 1]) * _INV[xi[:, k:] - xi[:, : n - k]])
    # Horner-style expansion of the Newton form from the highest coefficient down,
    # p <- p * (X - x_i) + dd_i; after the step for i, p has degree n - 1 - i.
    coeffs = np.zeros((c, n), dtype=np.float64)
    coeffs[:, 0] = dd[:, n - 1]
    for i in range(n - 2, -1, -1):
        deg = n - 1 - i  # degree after this step
        prev = coeffs[:, :deg].copy()
        coeffs[:, 1 : deg + 1] = prev
        coeffs[:, 0] = 0.0
        coeffs[:, :deg] = _reduce(coeffs[:, :deg] - prev * xf[:, i : i + 1])
        coeffs[:, 0] = _reduce(coeffs[:, 0] + dd[:, i])
    return coeffs.astype(np.int64) % P


def evaluate(coeffs: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Values [C, m] of polynomials coeffs [C, n] at points x [C, m] (Horner), in GF(P).

    Reduced every second step, in place: after a reduction |acc| < 2P, so two steps reach at most
    (2P * P + P) * P + P < 5.7e14 < 2**52 and every value stays an exact integer (`_reduce`); the result is
    the one a reduction every step gives, at half the reductions (a validator evaluates 128 points of a
    degree-127 polynomial per proof chunk, a few hundred chunks a round). In torch, whose fused multiply-add
    (`addcmul`) and scaled subtraction make a step one pass and a reduction three: 256 chunks in 3.1 ms against
    numpy's 5.0 (2-core CPU machine, one thread); exact integers either way, so the same values."""
    cf = torch.from_numpy((np.asarray(coeffs, dtype=np.int64) % P).astype(np.float64))
    xf = torch.from_numpy((np.asarray(x, dtype=np.int64) % P).astype(np.float64))
    acc = cf[:, -1:].expand(-1, xf.shape[1]).clone()
    scratch = torch.empty_like(acc)
    for step, j in enumerate(range(cf.shape[1] - 2, -1, -1)):
        torch.addcmul(cf[:, j : j + 1], acc, xf, out=acc)
        if step % 2 == 1 or j == 0:  # acc - floor(acc / P) * P, as `_reduce`
            torch.mul(acc, _INV_P, out=scratch).floor_()
            acc.add_(scratch, alpha=-P)
    return acc.numpy().astype(np.int64) % P
