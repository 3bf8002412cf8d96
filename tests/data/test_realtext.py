"""Real-text token streams: Qwen's BPE vocabulary (shipped in dashscope) over Python's own docs."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from ple.data import realtext
from ple.errors import InvalidArgumentError


def test_tokenizer_gives_qwen_ids_and_round_trips():
    enc = realtext.tokenizer()
    assert enc.n_vocab == realtext.QWEN_ENDOFTEXT + 1 == 151644
    # ids of Qwen's published vocabulary ("Hello" 9707, " world" 1879, "," 11)
    assert enc.encode_ordinary("Hello world,") == [9707, 1879, 11]
    text = "The quick brown fox: def f(x):\n    return x ** 2  # 3.14159\n\n"
    assert enc.decode(enc.encode_ordinary(text)) == text


def test_documents_are_real_english_and_streams_are_cut_as_asked():
    first = next(realtext.documents())
    assert len(first) > 500 and " the " in first
    eos = 248044
    s = realtext.token_stream(5000, eos)
    assert s.shape == (5000,) and s.dtype == np.int64
    assert (s == eos).sum() >= 1 and s.max() == eos and s[s != eos].max() < realtext.QWEN_ENDOFTEXT
    docs = list(realtext.token_documents(limit_tokens=5000))
    joined = np.concatenate([np.append(d, eos) for d in docs])[:5000]
    assert (joined == s).all()
    r = realtext.requests(4, 100, eos, skip=50)
    assert r.shape == (4, 100) and (r.reshape(-1) == realtext.token_stream(450, eos)[50:]).all()
    # real text repeats itself: far fewer distinct tokens than positions
    assert np.unique(s).size < 0.5 * s.size


def test_missing_package_is_named(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "dashscope" else real(name, *a))
    with pytest.raises(realtext.RealTextError, match="pip install dashscope tiktoken"):
        realtext.vocab_path()


def test_tokenize_file_streams_in_blocks(tmp_path):
    text = "".join(next(realtext.documents()) for _ in range(1)) * 3
    text = text + "\x0c" + "second document\nwith lines\n"
    p = tmp_path / "doc.txt"
    p.write_text(text)
    eos = 7
    whole = np.concatenate(list(realtext.tokenize_file(p, eos, block_bytes=1 << 22)))
    small = list(realtext.tokenize_file(p, eos, block_bytes=1000))
    assert len(small) > 3
    enc = realtext.tokenizer()
    a, b = text.split("\x0c")
    want = enc.encode_ordinary(a) + [eos] + enc.encode_ordinary(b)
    assert whole.tolist() == want
    # cut at line ends, blocks tokenize as the whole would except where a block ends
    assert abs(sum(x.size for x in small) - len(want)) <= len(small)
    assert enc.decode(np.concatenate(small)[np.concatenate(small) != eos].tolist()) == a + b
    (tmp_path / "bad.txt").write_bytes(b"ok\n\xff\xfe")
    with pytest.raises(InvalidArgumentError, match="not UTF-8 text"):
        list(realtext.tokenize_file(tmp_path / "bad.txt", eos))
    with pytest.raises(InvalidArgumentError, match="is missing"):
        list(realtext.tokenize_file(tmp_path / "none.txt", eos))
