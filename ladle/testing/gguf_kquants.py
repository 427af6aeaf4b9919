"""K-quant block bytes (Q4_K, Q5_K, Q6_K) from float weights, for the tests' GGUF files: gguf-py dequantizes
these types but does not quantize them (gguf.quants.quantize raises NotImplementedError). quantize_file
re-encodes an F32 file's decoder weights in them, as llama.cpp's llama-quantize turns a converted file into a
Q4_K_M one (ladle.testing.gguf_checkpoints writes the F32 file).

A plain round-to-nearest, not llama.cpp's scale search (make_qkx2_quants / make_qx_quants): the tests compare
ladle with transformers on the same file, both widening through gguf's dequantize, so only the layout has to be
llama.cpp's (ggml's block_q4_K, block_q5_K, block_q6_K), not the choice of scales. The weights come back close to
the floats (a 4-bit weight within a step of its sub-block's scale), so a file keeps the model's behaviour.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

QK_K = 256  # weights a super-block
BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def quantize_k(values: np.ndarray, qtype: str) -> np.ndarray:
    """values [rows, in] float (in a multiple of 256) -> [rows, in / 256 * block bytes] uint8 in qtype."""
    if qtype not in BLOCK_BYTES:
        raise ValueError(f"quantize_k writes {', '.join(BLOCK_BYTES)}, not {qtype}")
    rows, cols = values.shape
    if cols % QK_K:
        raise ValueError(f"{qtype} rows are whole {QK_K}-weight super-blocks; got {cols} columns")
    x = np.asarray(values, dtype=np.float32).reshape(-1, QK_K)
    blocks = _q6_k(x) if qtype == "Q6_K" else _q45_k(x, 5 if qtype == "Q5_K" else 4)
    return blocks.reshape(rows, cols // QK_K * BLOCK_BYTES[qtype])


def _f16(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(fp16 bytes [n, 2], the fp16 values as fp32 [n, 1]): later steps round against what the file holds."""
    half = v.astype(np.float16)
    return half.view(np.uint8).reshape(-1, 2), half.astype(np.float32).reshape(-1, 1)


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """num / den, 0 where den is 0 (an all-zero sub-block)."""
    return np.divide(num, den, out=np.zeros(np.broadcast(num, den).shape, np.float32), where=den != 0)


def _q45_k(x: np.ndarray, bits: int) -> np.ndarray:
    """Q4_K / Q5_K: weight = (d * sc) * q - dmin * mn per 32-weight sub-block, q in [0, 2^bits)."""
    n, top = x.shape[0], (1 << bits) - 1
    sub = x.reshape(n, 8, 32)
    low = np.maximum(-sub.min(axis=-1), 0.0)  # mn * dmin: the sub-block's minimum, offset to 0 (never below)
    scale = (sub.max(axis=-1) + low) / top
    d_bytes, d = _f16(scale.max(axis=-1) / 63)
    dmin_bytes, dmin = _f16(low.max(axis=-1) / 63)
    sc = np.clip(np.rint(_ratio(scale, d)), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(_ratio(low, dmin)), 0, 63).astype(np.uint8)
    step, offset = (d * sc)[..., None], (dmin * mn)[..., None]
    q = np.clip(np.rint(_ratio(sub + offset, step)), 0, top).astype(np.uint8)  # [n, 8, 32]
    # 12 scale bytes: sc/mn 0-3 in bytes 0-3 / 4-7 (low 6 bits), 4-7 in bytes 8-11's nibbles, their top 2 bits
    # in the top bits of bytes 0-3 / 4-7
    packed = np.concatenate([(sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6), (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)], axis=-1).astype(np.uint8)
    nibbles = q & 15
    qs = (nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).reshape(n, 128)  # bytes 32c + i: sub-blocks 2c, 2c + 1
    parts = [d_bytes, dmin_bytes, packed]
    if bits == 5:  # bit j of qh[i]: the fifth bit of weight i of sub-block j
        parts.append(((q >> 4) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1, dtype=np.uint8))
    return np.concatenate(parts + [qs], axis=-1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    """Q6_K: weight = (d * scale) * (q - 32) per 16-weight sub-block, q in [0, 64), scale int8."""
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    scale = np.abs(sub).max(axis=-1) / 31
    d_bytes, d = _f16(scale.max(axis=-1) / 127)
    sc = np.clip(np.rint(_ratio(scale, d)), -128, 127).astype(np.int8)
    q = (np.clip(np.rint(_ratio(sub, (d * sc)[..., None])), -32, 31) + 32).astype(np.uint8).reshape(n, 2, 4, 32)
    # weight 128h + 32t + i: low nibble in ql[64h + 32(t % 2) + i] at shift 4 (t // 2), high 2 bits in
    # qh[32h + i] at shift 2t
    low = q & 15
    ql = (low[:, :, :2] | (low[:, :, 2:] << 4)).reshape(n, 128)
    qh = ((q >> 4) << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]).sum(axis=2, dtype=np.uint8)
    return np.concatenate([ql, qh.reshape(n, 64), sc.view(np.uint8), d_bytes], axis=-1)


def quantize_file(src: str | Path, dst: str | Path, qtype: str, by_name: dict[str, str] | None = None) -> Path:
    """Copy the GGUF file src (weights F32) to dst with every 2-D decoder weight (blk.N.*.weight) in qtype, or
    in by_name's type for a tensor whose name holds one of its keys (Q4_K_M keeps ffn_down in Q6_K: by_name
    {"ffn_down": "Q6_K"}); metadata, norms, embedding and head as src has them, general.file_type set to
    qtype's (the _M variant for Q4_K and Q5_K, as llama.cpp names its mixes). Returns dst."""
    import gguf

    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)  # writes general.architecture itself
    file_type = {"Q4_K": gguf.LlamaFileType.MOSTLY_Q4_K_M, "Q5_K": gguf.LlamaFileType.MOSTLY_Q5_K_M,
                 "Q6_K": gguf.LlamaFileType.MOSTLY_Q6_K}[qtype]
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = int(file_type) if field.name == "general.file_type" else field.contents()
        array = field.types[0] == gguf.GGUFValueType.ARRAY
        writer.add_key_value(field.name, value, field.types[0], sub_type=field.types[-1] if array else None)
    for tensor in reader.tensors:
        values = np.asarray(tensor.data)
        if tensor.name.startswith("blk.") and tensor.name.endswith(".weight") and values.ndim == 2:
            if tensor.tensor_type != gguf.GGMLQuantizationType.F32:
                raise ValueError(f"{src}: {tensor.name} is {tensor.tensor_type.name}; quantize_file reads F32")
            kind = next((t for key, t in (by_name or {}).items() if key in tensor.name), qtype)
            writer.add_tensor(tensor.name, quantize_k(values, kind), raw_dtype=gguf.GGMLQuantizationType[kind])
        else:
            writer.add_tensor(tensor.name, np.array(values))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
