"""TextStream (incremental detokenizing + stop strings) equals decoding the whole sequence.

The reference is the loop Cascade.stream ran before TextStream: after each chunk, decode all
the tokens so far, cut at the first stop string, hand out up to ``_settled``. TextStream must
hand out exactly the same pieces at the same chunks, and stop at the same chunk, on the
bundled byte-level tokenizer, with random token ids (partial UTF-8 characters, special
tokens) and with stop strings that straddle chunks.
"""
from __future__ import annotations

import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from cascade.api import TextStream, _settled

ROOT = Path(__file__).resolve().parents[1]
TEXTS = ["naïve café ☕ — 你好，世界 🙂🚀 ü", "def f(x):\n    return x  # ünïcödé ✓\n", "日本語のテキスト 🎉 and ascii"]


@pytest.fixture(scope="module")
def bundled():
    return AutoTokenizer.from_pretrained(ROOT / "examples" / "models" / "large")


def reference(tokenizer, chunks, stops):
    """The pieces (and the chunk index that stopped) of the decode-everything-each-time loop."""
    ids, sent, out = [], 0, []
    for k, chunk in enumerate(chunks):
        ids.extend(chunk)
        full = tokenizer.decode(ids, skip_special_tokens=True)
        cut = min((full.find(s) for s in stops if s in full), default=-1)
        text = full[:cut] if cut >= 0 else full
        final = cut >= 0 or k == len(chunks) - 1
        safe = len(text) if final else _settled(text, stops)
        out.append(text[sent:safe] if safe > sent else "")
        sent = max(sent, safe)
        if cut >= 0:
            return out, k
    return out, None


def incremental(tokenizer, chunks, stops):
    stream, out = TextStream(tokenizer, stops), []
    for k, chunk in enumerate(chunks):
        out.append(stream.add(chunk, final=k == len(chunks) - 1))
        if stream.stopped:
            return out, k
    return out, None


def random_ids(rng, tokenizer, n):
    """Token ids mixing encoded multi-byte text, random ids (lone UTF-8 bytes) and EOS."""
    ids = []
    while len(ids) < n:
        kind = rng.random()
        if kind < 0.4:
            ids += tokenizer.encode(rng.choice(TEXTS), add_special_tokens=False)[:rng.randint(1, 12)]
        elif kind < 0.95:
            ids += [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 6))]
        else:
            ids.append(tokenizer.eos_token_id)
    return ids[:n]


def split(rng, ids):
    chunks, i = [], 0
    while i < len(ids):
        j = i + rng.choice([1, 1, 1, 2, 3, 5, 8])
        chunks.append(ids[i:j])
        i = j
    return chunks


@pytest.mark.parametrize("seed", range(40))
def test_pieces_equal_decoding_the_whole_sequence(bundled, seed):
    tokenizer = bundled
    rng = random.Random(seed)
    ids = random_ids(rng, tokenizer, rng.randint(1, 120))
    chunks = split(rng, ids)
    full = tokenizer.decode(ids, skip_special_tokens=True)
    # no stop strings: the pieces concatenate to the whole decoding
    got, stopped = incremental(tokenizer, chunks, [])
    assert "".join(got) == full and stopped is None
    assert got == reference(tokenizer, chunks, [])[0]
    # stop strings taken from the text itself (so they straddle chunks), one absent, one of
    # several characters that begins with a multi-byte one
    for _ in range(3):
        if len(full) < 2:
            break
        a = rng.randrange(len(full) - 1)
        stops = [full[a:a + rng.randint(2, 6)], "\x00never", full[rng.randrange(len(full)):][:3] or "x"]
        want = reference(tokenizer, chunks, stops)
        assert incremental(tokenizer, chunks, stops) == want, stops
        cut = min((full.find(s) for s in stops if s in full), default=-1)
        assert "".join(want[0]) == (full[:cut] if cut >= 0 else full)


def test_text_held_back_while_it_may_become_a_stop_string(bundled):
    tokenizer = bundled
    ids = tokenizer.encode("abc END xyz", add_special_tokens=False)
    stream = TextStream(tokenizer, ["END"])
    pieces = [stream.add([t]) for t in ids]
    assert "".join(pieces) == "abc " and stream.stopped
    assert stream.add(tokenizer.encode("more", add_special_tokens=False)) == "" and stream.finish() == ""


def test_an_incomplete_utf8_character_waits_for_its_last_byte(bundled):
    tokenizer = bundled
    ids = tokenizer.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1  # byte-level: the emoji takes several tokens
    stream = TextStream(tokenizer)
    assert [stream.add([t]) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert stream.add(ids[-1:]) == "🙂"


def test_an_unfinished_character_is_handed_out_at_the_end(bundled):
    tokenizer = bundled
    ids = tokenizer.encode("🙂", add_special_tokens=False)[:-1]
    stream = TextStream(tokenizer)
    assert stream.add(ids) == ""
    assert stream.finish() == tokenizer.decode(ids) and "\ufffd" in tokenizer.decode(ids)


def test_without_a_tokenizer_the_text_is_empty():
    stream = TextStream(None)
    assert stream.add([1, 2, 3]) == "" and stream.finish() == "" and not stream.stopped


def test_result_of_a_batched_request_honours_its_stop_strings(family, tmp_path):
    from cascade import Cascade
    from conftest import family_topology, write_topology

    path = write_topology(tmp_path / "c.yaml", family_topology(family, ["tiny", "large"]))
    with Cascade.from_topology(path) as c:
        free = c.generate("import os\n", max_new_tokens=40, temperature=0.0)
        stop = free.text[4:7]
        want = c.generate("import os\n", max_new_tokens=40, temperature=0.0, stop=stop)
        assert want.finish_reason == "stop" and want.text == free.text[:free.text.find(stop)]
        # the same request through a batch, its text streamed by a TextStream, then result(stop=)
        state, batch, text, pieces = c.request("import os\n", max_new_tokens=40, temperature=0.0), c.batch(), \
            c.text_stream(stop), []
        batch.add(state)
        while batch.active:
            for s, new in batch.step():
                pieces.append(text.add(new, final=s.finish_reason is not None))
                if text.stopped:
                    s.finish_reason = "stop"
        batch.close()
        got = c.result(state, "import os\n", stop=stop)
        assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, "stop")
        assert "".join(pieces) == want.text
        # generate(batch_size=2) finds the same stop
        both = c.generate(["import os\n", "import os\n"], max_new_tokens=40, temperature=0.0, stop=stop, batch_size=2)
        assert [g.token_ids for g in both] == [want.token_ids] * 2
