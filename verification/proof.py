"""TOPLOC-style proofs: per chunk of 32 generated tokens, a 258-byte commitment to its top-128
final hidden-state values.

Layout, byte for byte the `toploc` package's (so either side can check the other's proofs):
2-byte modulus m, then k 2-byte coefficients (ascending powers), all big-endian, of the polynomial
over GF(65497) through (flat index mod m, bf16 bits) of the chunk's top-k entries by magnitude.
The flat index runs over the chunk's [tokens, hidden] block in row-major order; values are
rounded to bf16 first (the engine may run in float32).
Chunks never straddle policy versions: a rollout's tokens are cut into runs of one version, and
each run into chunks of 32, so every chunk is bound to exactly one version's manifest hash.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from protocol.errors import InvalidProof
from verification.poly import P, injective_modulus, interpolate

TOPK = 128
"""Entries committed per chunk (TOPLOC's k)."""
CHUNK_TOKENS = 32
"""Generated tokens per chunk (TOPLOC's decode batching size)."""
PROOF_BYTES = 2 + 2 * TOPK
"""Bytes per full chunk proof."""


@dataclass(frozen=True)
class ChunkSpan:
    """Generated tokens [start, end) of one rollout, all produced by `version`."""

    version: int
    start: int
    end: int


def chunk_spans(versions: list[int], chunk_tokens: int = CHUNK_TOKENS) -> list[ChunkSpan]:
    """Cut a rollout's per-token versions into version runs, and each run into chunks."""
    spans: list[ChunkSpan] = []
    run_start = 0
    for i in range(1, len(versions) + 1):
        if i == len(versions) or versions[i] != versions[run_start]:
            for s in range(run_start, i, chunk_tokens):
                spans.append(ChunkSpan(versions[run_start], s, min(s + chunk_tokens, i)))
            run_start = i
    return spans

PARSE_TOGETHER = 8
"""Chunk proofs of a rollout parsed as one array from this many (`Commitment.many_from_bytes`): measured on the
2-core CPU machine, 2 chunks 7 us one by one against 11 us together, 32 chunks 114 against 34 us; the
crossing lies between 4 and 8."""


@dataclass(frozen=True)
class Commitment:
    """A parsed chunk proof: the modulus and the polynomial's coefficients."""

    modulus: int
    coeffs: np.ndarray  # int64 [k]

    def to_bytes(self) -> bytes:
        words = np.concatenate([[self.modulus], self.coeffs]).astype(">u2")
        return words.tobytes()

    @classmethod
    def from_bytes(cls, data: bytes, topk: int = TOPK) -> "Commitment":
        if len(data) < 4 or len(data) % 2 or len(data) > 2 + 2 * topk:
            raise InvalidProof(f"chunk proof of {len(data)} bytes; expected at most {2 + 2 * topk}, even")
        words = np.frombuffer(data, dtype=">u2").astype(np.int64)
        modulus, coeffs = int(words[0]), words[1:]
        if modulus < 2 or modulus > P or bool((coeffs >= P).any()):
            raise InvalidProof(f"chunk proof out of range (modulus {modulus})")
        return cls(modulus, coeffs)

    @classmethod
    def many_from_bytes(cls, chunks: list[bytes], topk: int = TOPK) -> list["Commitment"]:
        """`from_bytes` of each chunk, the same results and the same first error; from `PARSE_TOGETHER` chunks
        of one valid size (a long rollout's) parsed as one array."""
        size = len(chunks[0]) if chunks else 0
        if (len(chunks) < PARSE_TOGETHER or size < 4 or size % 2 or size > 2 + 2 * topk
                or any(len(c) != size for c in chunks)):
            return [cls.from_bytes(c, topk) for c in chunks]
        words = np.frombuffer(b"".join(chunks), dtype=">u2").astype(np.int64).reshape(len(chunks), size // 2)
        moduli = words[:, 0]
        bad = (moduli < 2) | (moduli > P) | (words[:, 1:] >= P).any(axis=1)
        if bool(bad.any()):
            raise InvalidProof(f"chunk proof out of range (modulus {int(moduli[int(bad.argmax())])})")
        return [cls(int(m), row[1:]) for m, row in zip(moduli.tolist(), words)]


def chunk_blocks(hidden: torch.Tensor, spans: list[ChunkSpan]) -> list[torch.Tensor]:
    """The flat bf16 block of each span's rows of `hidden` [n_gen, H]."""
    h = hidden.to(torch.bfloat16)
    return [h[s.start : s.end].reshape(-1) for s in spans]


def topk_points(blocks: list[torch.Tensor], topk: int = TOPK) -> list[tuple[np.ndarray, np.ndarray]]:
    """(flat indices, bf16 bit patterns) of each block's top-k entries by magnitude.

    Blocks of equal length go through one batched `topk` call; every group's points come back to the host
    in one transfer (a GPU validator's round holds blocks of a few dozen lengths: one wait, not two each)."""
    out: list[tuple[np.ndarray, np.ndarray] | None] = [None] * len(blocks)
    by_len: dict[int, list[int]] = {}
    for i, b in enumerate(blocks):
        by_len.setdefault(b.numel(), []).append(i)
    parts, shapes = [], []
    for n, members in by_len.items():
        stack = torch.stack([blocks[i] for i in members])
        k = min(topk, n)
        # top-k runs where the hidden states are (the GPU engine keeps them there); 2 x k values come back
        idx = stack.abs().topk(k, dim=-1).indices
        bits = stack.gather(-1, idx).view(torch.int16).long() & 0xFFFF
        parts += [idx.reshape(-1), bits.reshape(-1)]
        shapes.append((members, k))
    if not parts:
        return []
    host = (torch.cat(parts) if len(parts) > 1 else parts[0]).cpu().numpy()
    at = 0
    for members, k in shapes:
        size = len(members) * k
        idx, bits = host[at : at + size].reshape(-1, k), host[at + size : at + 2 * size].reshape(-1, k)
        at += 2 * size
        for row, i in enumerate(members):
            out[i] = (idx[row], bits[row])
    return out  # type: ignore[return-value]


def commit(points: list[tuple[np.ndarray, np.ndarray]]) -> list[Commitment]:
    """One commitment per (indices, bits) pair; equal-size pairs are interpolated together."""
    out: list[Commitment | None] = [None] * len(points)
    by_k: dict[int, list[int]] = {}
    for i, (x, _) in enumerate(points):
        by_k.setdefault(len(x), []).append(i)
    for _, members in by_k.items():
        moduli = [injective_modulus(points[i][0]) for i in members]
        xs = np.stack([points[i][0] % m for i, m in zip(members, moduli)])
        ys = np.stack([points[i][1] for i in members])
        coeffs = interpolate(xs, ys)
        for row, (i, m) in enumerate(zip(members, moduli)):
            out[i] = Commitment(m, coeffs[row])
    return out  # type: ignore[return-value]


def build_proofs(hidden: torch.Tensor, versions: list[int]) -> list[tuple[ChunkSpan, bytes]]:
    """Proofs of one rollout from the engine's captured hidden states [n_gen, H]."""
    return build_proofs_many([(hidden, versions)])[0]


def build_proofs_many(rollouts: list[tuple[torch.Tensor, list[int]]]) -> list[list[tuple[ChunkSpan, bytes]]]:
    """Proofs of many rollouts at once (one batched top-k and interpolation for all chunks)."""
    all_spans = [chunk_spans(v) for _, v in rollouts]
    for (h, v), spans in zip(rollouts, all_spans):
        if h.shape[0] != len(v):
            raise ValueError(f"hidden has {h.shape[0]} rows for {len(v)} tokens")
    blocks = [b for (h, _), spans in zip(rollouts, all_spans) for b in chunk_blocks(h, spans)]
    commitments = iter(commit(topk_points(blocks)))
    return [[(s, next(commitments).to_bytes()) for s in spans] for spans in all_spans]


# ---- the wire form of a rollout's proofs ------------------------------------------------------
_MAGIC = b"TLP1"


@dataclass(frozen=True)
class VersionRun:
    """Proofs of one run of tokens produced by one policy version."""

    version: int
    manifest_hash: bytes  # 32 bytes: the signed manifest of `version` (shardcast)
    n_tokens: int
    chunks: list[bytes]


def chunk_proof_len(n_tokens: int, hidden_size: int, topk: int = TOPK) -> int:
    return 2 + 2 * min(topk, n_tokens * hidden_size)


def encode_rollout_proof(runs: list[VersionRun]) -> bytes:
    """`TLP1`, u16 run count, then per run: u32 version, 32-byte manifest hash, u32 token count,
    and the run's chunk proofs (toploc layout) back to back. Big-endian."""
    out = [_MAGIC, len(runs).to_bytes(2, "big")]
    for r in runs:
        if len(r.manifest_hash) != 32:
            raise ValueError("manifest hash must be 32 bytes")
        out += [r.version.to_bytes(4, "big"), r.manifest_hash, r.n_tokens.to_bytes(4, "big"), *r.chunks]
    return b"".join(out)


def decode_rollout_proof(data: bytes, hidden_size: int, chunk_tokens: int = CHUNK_TOKENS) -> list[VersionRun]:
    """Parse `encode_rollout_proof`'s bytes; raise `InvalidProof` on any inconsistency."""
    if len(data) < 6 or data[:4] != _MAGIC:
        raise InvalidProof("not a rollout proof (bad magic)")
    n_runs, pos, runs = int.from_bytes(data[4:6], "big"), 6, []
    for _ in range(n_runs):
        if pos + 40 > len(data):
            raise InvalidProof("rollout proof truncated in a run header")
        version = int.from_bytes(data[pos : pos + 4], "big")
        manifest_hash = bytes(data[pos + 4 : pos + 36])
        n_tokens = int.from_bytes(data[pos + 36 : pos + 40], "big")
        pos += 40
        if n_tokens < 1:
            raise InvalidProof("empty version run")
        chunks = []
        for s in range(0, n_tokens, chunk_tokens):
            size = chunk_proof_len(min(chunk_tokens, n_tokens - s), hidden_size)
            if pos + size > len(data):
                raise InvalidProof("rollout proof truncated in a chunk")
            chunks.append(bytes(data[pos : pos + size]))
            pos += size
        runs.append(VersionRun(version, manifest_hash, n_tokens, chunks))
    if pos != len(data):
        raise InvalidProof(f"{len(data) - pos} trailing bytes after the rollout proof")
    return runs


def prove_rollouts(rollouts: list[tuple[torch.Tensor, list[int]]], manifest_hashes: dict[int, bytes]) -> list[bytes]:
    """Wire proofs of many rollouts, built with one batched top-k and interpolation."""
    out = []
    for (_, versions), chunks in zip(rollouts, build_proofs_many(rollouts)):
        runs: list[VersionRun] = []
        for span, proof in chunks:
            if runs and runs[-1].version == span.version and span.start == sum(r.n_tokens for r in runs):
                runs[-1] = VersionRun(span.version, runs[-1].manifest_hash, runs[-1].n_tokens + span.end - span.start,
                                      runs[-1].chunks + [proof])
            else:
                runs.append(VersionRun(span.version, manifest_hashes[span.version], span.end - span.start, [proof]))
        out.append(encode_rollout_proof(runs))
    return out
