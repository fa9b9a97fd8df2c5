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


def interpolate(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Coefficients [C, n] (ascending powers) of the polynomials through rows of x, y [C, n] in GF(P).

    Each row of x must hold distinct residues in [0, P)."""
    x = np.asarray(x, dtype=np.int64) % P
    dd = np.asarray(y, dtype=np.int64) % P
    c, n = x.shape
    dd = dd.copy()
    # Newton divided differences, in place: after step k, dd[:, i] = f[x_{i-k} .. x_i] for i >= k.
    for k in range(1, n):
        num = (dd[:, k:] - dd[:, k - 1 : n - 1]) % P
        den = (x[:, k:] - x[:, : n - k]) % P
        dd[:, k:] = num * _INV[den] % P
    # Horner-style expansion of the Newton form from the highest coefficient down:
    # p <- p * (X - x_i) + dd_i.
    coeffs = np.zeros((c, n), dtype=np.int64)
    coeffs[:, 0] = dd[:, n - 1]
    for i in range(n - 2, -1, -1):
        shifted = np.zeros_like(coeffs)
        shifted[:, 1:] = coeffs[:, :-1]
        coeffs = (shifted - coeffs * x[:, i : i + 1] % P) % P
        coeffs[:, 0] = (coeffs[:, 0] + dd[:, i]) % P
    return coeffs


def evaluate(coeffs: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Values [C, m] of polynomials coeffs [C, n] at points x [C, m] (Horner), in GF(P)."""
    coeffs = np.asarray(coeffs, dtype=np.int64)
    x = np.asarray(x, dtype=np.int64) % P
    acc = np.repeat(coeffs[:, -1:], x.shape[1], axis=1)
    for j in range(coeffs.shape[1] - 2, -1, -1):
        acc = (acc * x + coeffs[:, j : j + 1]) % P
    return acc
