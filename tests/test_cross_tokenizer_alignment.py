"""Alignment of two tokenizations of the same text, on hand-written BPEs whose segmentations we choose."""

from __future__ import annotations

import json

import pytest
from tiny_tokenizers import EOS, bpe

from distill_kit.data.alignment import (
    MERGE,
    NONE,
    ONE_TO_ONE,
    SPLIT,
    VocabMap,
    align,
    encode,
    encode_documents,
)
from distill_kit.data.paired_blocks import cut_points, tokenize_to_paired_blocks


def pieces(tokenizer, encoding):
    return tokenizer.convert_ids_to_tokens(encoding.ids)


def test_merge_one_student_token_over_two_teacher_tokens():
    student = bpe("h e", "l l", "he ll", "hell o")
    teacher = bpe("h e", "l l", "ll o")
    s, t = encode(student, "x hello"), encode(teacher, "x hello")
    assert pieces(student, s) == ["x", "Ġ", "hello"] and pieces(teacher, t) == ["x", "Ġ", "he", "llo"]
    a = align(s, t)
    # row 0 predicts "Ġ" (teacher row 0 predicts the same Ġ); row 1 predicts "hello" = teacher rows 1 ("he") and 2
    assert a.kind == [ONE_TO_ONE, MERGE, NONE]
    assert a.teacher_row[:2] == [0, 1] and a.teacher_last[:2] == [0, 2]


def test_split_rows_use_the_teacher_row_that_has_read_no_further():
    student = bpe("a b")  # "ab", "c"
    teacher = bpe("b c")  # "a", "bc"
    s, t = encode(student, "xabc"), encode(teacher, "xabc")
    assert pieces(student, s) == ["x", "ab", "c"] and pieces(teacher, t) == ["x", "a", "bc"]
    a = align(s, t)
    # span "abc" is ["ab", "c"] against ["a", "bc"]: no shared boundary inside, so both student rows are SPLIT.
    # Predicting "ab" (starts at byte 1): the teacher has read "x" (row 0). Predicting "c" (byte 3): the teacher
    # has read "xa" (row 1, which predicts "bc"); row 2 would have read "bc", past the student.
    assert a.kind == [SPLIT, SPLIT, NONE]
    assert a.teacher_row[:2] == [0, 1]


def test_multibyte_character_split_into_byte_tokens_on_one_side():
    whole = bpe("Ã ©")  # "é" is one token
    bytewise = bpe()  # "é" is two byte-level tokens, both reporting the character's range
    text = "xé!"
    w, b = encode(whole, text), encode(bytewise, text)
    assert pieces(bytewise, b) == ["x", "Ã", "©", "!"] and b.starts[1:3] == [1, 2] and b.ends[1:3] == [2, 3]
    assert b.byte_counts() == [1, 1, 1, 1] and w.byte_counts() == [1, 2, 1]
    assert align(b, b).kind == [ONE_TO_ONE] * 3 + [NONE]  # pieces split alike align piece by piece
    merged = align(w, b)  # student whole: its one token is the teacher's two bytes
    assert merged.kind == [MERGE, ONE_TO_ONE, NONE] and merged.teacher_row[:2] == [0, 2]
    assert merged.teacher_last[0] == 1
    split = align(b, w)  # student bytewise: both pieces compared with the teacher's prediction of "é"
    assert split.kind == [SPLIT, SPLIT, ONE_TO_ONE, NONE] and split.teacher_row[:3] == [0, 0, 1]


def test_whitespace_runs_segmented_differently():
    student = bpe("Ġ Ġ", "ĠĠ ĠĠ")  # four spaces are one token
    teacher = bpe("Ġ Ġ")  # two-space tokens
    text = "a    \n"
    s, t = encode(student, text), encode(teacher, text)
    assert pieces(student, s) == ["a", "ĠĠĠĠ", "Ċ"] and pieces(teacher, t) == ["a", "ĠĠ", "ĠĠ", "Ċ"]
    a = align(s, t)
    assert a.kind == [MERGE, ONE_TO_ONE, NONE]
    assert (a.teacher_row[0], a.teacher_last[0]) == (0, 1) and a.teacher_row[1] == 2
    assert align(t, s).kind == [SPLIT, SPLIT, ONE_TO_ONE, NONE]
    assert sum(s.byte_counts()) == sum(t.byte_counts()) == len(text.encode())


def test_documents_end_with_eos_on_both_sides_and_special_tokens_align():
    student, teacher = bpe("a b"), bpe()
    docs = ["ab", f"x{EOS}y"]  # a special token written in the text is one token on both sides
    s, t = encode_documents(student, docs), encode_documents(teacher, docs)
    assert pieces(student, s) == ["ab", EOS, "x", EOS, "y", EOS]
    assert pieces(teacher, t) == ["a", "b", EOS, "x", EOS, "y", EOS]
    assert s.ends[1] == t.ends[2] == 3  # "ab" is bytes 0-2, its EOS the one virtual byte after
    a = align(s, t)
    assert a.kind == [ONE_TO_ONE] * 5 + [NONE]
    assert a.teacher_row[:5] == [1, 2, 3, 4, 5]  # student row 0 predicts the first EOS, teacher row 1 too
    assert sum(s.byte_counts()) == sum(t.byte_counts()) == len("ab") + 1 + len(docs[1]) + 1


def test_trimmed_offsets_are_refused_with_the_fix():
    trimmed = bpe(trim_offsets=True)
    with pytest.raises(ValueError, match="skip or overlap text.*trim_offsets=False"):
        encode(trimmed, "a  b")


def test_vocab_map_pairs_tokens_of_equal_text_and_saves_as_json(tmp_path):
    student = bpe("h e", "l l", "he ll", "hell o")
    teacher = bpe("l l", "h e", "ll o")  # "he" and "ll" exist in both, at other ids
    vocab = VocabMap.build(student, teacher)
    pairs = dict(zip(vocab.student_ids, vocab.teacher_ids, strict=True))
    s_vocab, t_vocab = student.get_vocab(), teacher.get_vocab()
    for token in ["he", "ll", "a", "Ġ", EOS]:
        assert pairs[s_vocab[token]] == t_vocab[token]
    assert s_vocab["hello"] not in pairs and t_vocab["llo"] not in pairs.values()
    assert len(vocab) == 256 + 1 + 2
    loaded = VocabMap.load(vocab.save(tmp_path / "vocab_map.json"))
    assert loaded == vocab
    (tmp_path / "bad.json").write_text(json.dumps({"format": 1, "pairs": [["__import__('os')", 1]]}))
    with pytest.raises(ValueError, match="two token ids"):
        VocabMap.load(tmp_path / "bad.json")


def test_blocks_cut_at_shared_boundaries_and_keep_every_token():
    student, teacher = bpe("h e", "l l", "he ll", "hell o"), bpe("h e", "l l", "ll o")
    docs = ["hello hello hello", "oh hello"]
    s, t = encode_documents(student, docs), encode_documents(teacher, docs)
    cuts = list(cut_points(s, t, block_size=6, teacher_block_size=6))
    assert cuts[0][0][0] == cuts[0][1][0] == 0 and cuts[-1][0][1] == len(s) and cuts[-1][1][1] == len(t)
    for ((s0, s1), (t0, t1)), ((n0, _), (m0, _)) in zip(cuts, cuts[1:], strict=False):
        assert (s1, t1) == (n0, m0) and s1 - s0 <= 6 and t1 - t0 <= 6
        assert s.ends[s1 - 1] == t.ends[t1 - 1]  # both blocks end on the same byte: the same text


def test_a_span_longer_than_a_block_is_cut_inside_and_not_compared():
    student, teacher = bpe(), bpe("a a", "aa aa", "aaaa aaaa")  # teacher: "aaaaaaaa" is one token
    s, t = encode(student, "aaaaaaaab"), encode(teacher, "aaaaaaaab")
    cuts = list(cut_points(s, t, block_size=4, teacher_block_size=4))
    assert cuts[0] == ((0, 4), (0, 1)) and cuts[-1][0][1] == len(s)
    second = align(s.window(*cuts[1][0]), t.window(*cuts[1][1]))
    assert set(second.kind) == {NONE}  # starts on different bytes on the two sides: nothing compared


def test_paired_dataset_columns_and_bytes(tmp_path):
    import datasets

    student, teacher = bpe("h e", "l l", "he ll", "hell o"), bpe("h e", "l l", "ll o")
    data = datasets.Dataset.from_dict({"text": ["hello héllo", "oh hello"]})
    blocks = tokenize_to_paired_blocks(data, student, teacher_tokenizer=teacher, block_size=8, teacher_block_size=10)
    rows = blocks[:]
    assert all(len(v) == 8 for v in rows["input_ids"]) and all(len(v) == 10 for v in rows["teacher_input_ids"])
    total = sum(len(text.encode()) + 1 for text in data["text"])
    assert sum(map(sum, rows["token_bytes"])) == sum(map(sum, rows["teacher_token_bytes"])) == total
    for labels, mask in zip(rows["teacher_labels"], rows["teacher_attention_mask"], strict=True):
        assert all((label == -100) == (m == 0) for label, m in zip(labels, mask, strict=True))


def test_tokenizer_mismatch_errors_name_the_loss_to_use(tmp_path):
    from distill_kit.teachers.tokenizers import tokenizer_problems
    from distill_kit.training.plan import vocabulary_problems

    for name, tokenizer in (("teacher", bpe("a b")), ("student", bpe())):
        tokenizer.save_pretrained(tmp_path / name)
    (problem,) = tokenizer_problems(("the run", tmp_path / "teacher"), [("students[s].model", tmp_path / "student")])
    assert problem.startswith("students[s].model: its tokenizer differs from the run's")
    assert "loss cross_tokenizer with student_tokenizer" in problem
    (problem,) = vocabulary_problems(300, 260, "student")
    assert "use loss cross_tokenizer" in problem


def test_a_run_with_student_tokenizer_refuses_losses_that_compare_token_ids(tmp_path):
    from distill_kit.run import run_config, student_tokenizer

    config = run_config.load(None, ["student_tokenizer=bpe:300", f"output_dir={tmp_path}",
                                    "students=[{name: a, loss: [{name: cross_entropy, weight: 1}, "
                                    "{name: reverse_kl, weight: 1}]}]"])
    with pytest.raises(run_config.ConfigError, match=r"students\[a\].loss: reverse_kl .* Use cross_tokenizer"):
        student_tokenizer.prepare(config, config.data, bpe())
    bad_size = run_config.load(None, ["student_tokenizer=bpe:100", f"output_dir={tmp_path}",
                                      "students=[{name: a, loss: cross_tokenizer}]"])
    with pytest.raises(run_config.ConfigError, match="above 256"):
        student_tokenizer.prepare(bad_size, bad_size.data, bpe())


def test_loader_fills_the_last_batch_with_paired_blocks_that_count_nothing():
    import datasets

    from distill_kit.data.blocks import BlockLoader

    student, teacher = bpe("h e", "l l", "he ll", "hell o"), bpe("h e", "l l", "ll o")
    data = datasets.Dataset.from_dict({"text": ["hello héllo oh", "oh hello x", "x y z hello"]})
    blocks = tokenize_to_paired_blocks(data, student, teacher_tokenizer=teacher, block_size=6)
    assert len(blocks) % 4 != 0
    loader = BlockLoader(blocks, 2, rank=1, world_size=2, shuffle=False, drop_last=False)
    last = list(loader)[-1]
    assert set(last) == set(blocks.column_names)
    filler = last["labels"][-1]
    assert (filler == -100).all() and (last["teacher_labels"][-1] == -100).all()
    assert last["teacher_input_ids"].shape[1] == 6 and last["align_kind"].shape == last["input_ids"].shape
