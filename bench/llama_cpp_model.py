"""A Llama-style GGUF model with random weights, for llama.cpp's tools (llama-bench,
llama-completion) with and without flywheel's ggml backend.

    python bench/llama_cpp_model.py OUT.gguf [--layers 2] [--embd 4096] [--ff 14336]
        [--heads 32] [--kv-heads 8] [--head-dim 128] [--vocab 512] [--ctx 32768]
        [--type q8_0|f16|f32]

Defaults: Llama-3-8B's layer (GQA 32:8, head dim 128, FFN 14336) with 2 layers and a
512-token SentencePiece-style vocabulary (the byte tokens and filler pieces), so that the file
is small and the attention of a long context is a real share of a step. gguf-py comes from
the llama.cpp tree whose tools run the model (PYTHONPATH=<llama.cpp>/gguf-py).
"""
import argparse

import numpy as np

import gguf


def vocab(n):
    tokens, scores, types = [b"<unk>", b"<s>", b"</s>"], [0.0, 0.0, 0.0], [
        gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    for b in range(256):
        tokens.append(b"<0x%02X>" % b)
        scores.append(0.0)
        types.append(gguf.TokenType.BYTE)
    i = 0
    while len(tokens) < n:
        tokens.append(("\u2581w%d" % i).encode())
        scores.append(-float(i))
        types.append(gguf.TokenType.NORMAL)
        i += 1
    return tokens, scores, types


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--embd", type=int, default=4096)
    ap.add_argument("--ff", type=int, default=14336)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--type", choices=("q8_0", "f16", "f32"), default="q8_0")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    rng = np.random.default_rng(a.seed)
    w = gguf.GGUFWriter(a.out, "llama")
    w.add_name("flywheel-llama-test")
    w.add_context_length(a.ctx)
    w.add_embedding_length(a.embd)
    w.add_block_count(a.layers)
    w.add_feed_forward_length(a.ff)
    w.add_head_count(a.heads)
    w.add_head_count_kv(a.kv_heads)
    w.add_key_length(a.head_dim)
    w.add_value_length(a.head_dim)
    w.add_rope_dimension_count(a.head_dim)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(a.vocab)
    w.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                     "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[a.type])
    tokens, scores, types = vocab(a.vocab)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)

    def matrix(name, rows, cols):
        x = (rng.standard_normal((rows, cols), dtype=np.float32) / np.sqrt(cols)).astype(np.float32)
        if a.type == "q8_0":
            q = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, x.astype(np.float16 if a.type == "f16" else np.float32))

    def norm(name, n):
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    qd, kd = a.heads * a.head_dim, a.kv_heads * a.head_dim
    w.add_tensor("token_embd.weight", rng.standard_normal((a.vocab, a.embd), dtype=np.float32))
    norm("output_norm.weight", a.embd)
    matrix("output.weight", a.vocab, a.embd)
    for i in range(a.layers):
        p = "blk.%d." % i
        norm(p + "attn_norm.weight", a.embd)
        matrix(p + "attn_q.weight", qd, a.embd)
        matrix(p + "attn_k.weight", kd, a.embd)
        matrix(p + "attn_v.weight", kd, a.embd)
        matrix(p + "attn_output.weight", a.embd, qd)
        norm(p + "ffn_norm.weight", a.embd)
        matrix(p + "ffn_gate.weight", a.ff, a.embd)
        matrix(p + "ffn_up.weight", a.ff, a.embd)
        matrix(p + "ffn_down.weight", a.embd, a.ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
