"""The real SmolLM2-135M-Instruct: converted once into the HF layout, loaded through the model spec,
logits equal to transformers', its own tokenizer with chat template and EOS."""

import pytest
import torch

from node.model.tokenizer import HFTokenizer, Tokenizer

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def smol(smollm2):
    return smollm2


def test_smollm2_directory_is_a_complete_hf_checkpoint(smol):
    names = {p.name for p in smol.directory.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= names
    assert smol.model.config.model_type == "llama" and smol.model.config.tie_word_embeddings
    assert smol.model.lm_head.weight is smol.model.model.embed_tokens.weight


def test_smollm2_logits_equal_transformers(smol):
    hf = transformers.AutoModelForCausalLM.from_pretrained(smol.directory, dtype=torch.float32).eval()
    ids = torch.tensor([smol.tokenizer.encode_prompt("The capital of France is Paris, and the capital of Italy is")])
    with torch.no_grad():
        diff = (smol.model(ids).logits - hf(ids).logits).abs().max().item()
    assert diff <= 1e-4


def test_smollm2_tokenizer_chat_template_and_eos(smol):
    tok = smol.tokenizer
    assert isinstance(tok, HFTokenizer) and isinstance(tok, Tokenizer)
    assert tok.vocab_size == 49152 and tok.eos_id == 2 and tok.stop_ids == (2,)
    ids = tok.encode_prompt([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    text = tok.hf.decode(ids)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>") and text.endswith("<|im_start|>assistant\n")
    assert tok.decode(tok.encode("dlrow olleh")) == "dlrow olleh"
    assert tok.decode(tok.encode("ab") + [tok.eos_id]) == "ab"  # specials are not text
