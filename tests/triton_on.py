"""Where a test runs Triton kernels: a GPU's Triton, or on the CPU Triton's interpreter (CI has no Triton: skipped)."""

import importlib.util

import pytest
import torch


def triton_on(device: str, monkeypatch) -> None:  # noqa: ANN001 - pytest's monkeypatch
    """Skip unless Triton can run the kernels on `device` ("cuda" or "cpu"); on the CPU turn its interpreter on
    (skipped where a GPU is: kernels the interpreter built would stay in this process for the GPU's tests), with
    a shim for Triton 3.6's interpreter, which converts 1-element loop bounds with int(array) that numpy >= 2.4
    rejects (the element is indexed instead; the GPU path does not use it)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("no Triton here")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no GPU")
    if device != "cpu":
        return
    if torch.cuda.is_available():
        pytest.skip("CPU-machine test: the GPU's variant covers the kernels here")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import triton.runtime.interpreter as interp

    orig = interp._patch_lang_tensor

    def patched(tensor, scope):  # noqa: ANN001
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    monkeypatch.setattr(interp, "_patch_lang_tensor", patched)
