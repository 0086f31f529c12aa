"""Dataset files: the seed datasets' layouts read from JSONL and parquet, images in every form they come
in, and one clear error naming the file, the row and the key for each kind of bad input.

The fixtures are written here in the datasets' own layouts (docs/data.md): DAPO-Math-17k (a chat-list
`prompt`, `reward_model.ground_truth`), AIME-2024 (`problem`, `answer`), lmms-lab's
multimodal-open-r1-8k-verified (`image` as a {bytes, path} struct, `problem`, `solution`) and its
verl-converted form (`<image>` in the prompt, an `images` list).
"""

from __future__ import annotations

import base64
import io
import json
import sys
from pathlib import Path

import pytest
from PIL import Image

from skyq.rl.datasets import DatasetError, local_file, read_records
from skyq.rl.images import decode

DAPO_INSTRUCTION = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)


def dapo_row(i: int) -> dict:
    """A row in DAPO-Math-17k's layout."""
    return {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": f"{DAPO_INSTRUCTION}What is {i} + {i}?"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": str(2 * i), "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": f"id-{i}"},
    }


def png(color: tuple[int, int, int], size: tuple[int, int] = (5, 3)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return buffer.getvalue()


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def records(path: Path, **keys) -> list:
    keys = {"prompt_key": "prompt", "label_key": "label", "image_key": None, **keys}
    return list(read_records(path, **keys))


def test_dapo_math_layout_reads_the_chat_prompt_and_the_struct_answer(tmp_path):
    path = write_jsonl(tmp_path / "dapo.jsonl", [dapo_row(i) for i in range(3)])
    got = records(path, label_key="reward_model.ground_truth")
    assert [r.answer for r in got] == ["0", "2", "4"]
    assert got[1].messages == dapo_row(1)["prompt"] and got[1].images == ()
    assert got[2].where == f"{path}:3"


def test_aime_layout_reads_problem_and_a_numeric_answer(tmp_path):
    path = write_jsonl(
        tmp_path / "aime.jsonl",
        [{"id": 60, "problem": "Find the remainder.", "solution": "...", "answer": 204, "year": 2024}],
    )
    (record,) = records(path, prompt_key="problem", label_key="answer")
    assert record.answer == "204"
    assert record.messages == [{"role": "user", "content": "Find the remainder."}]


def test_verl_one_element_ground_truth_lists_are_the_answer(tmp_path):
    row = {**dapo_row(4), "reward_model": {"ground_truth": ["8"], "style": "rule"}}
    path = write_jsonl(tmp_path / "verl.jsonl", [row])
    assert records(path, label_key="reward_model.ground_truth")[0].answer == "8"


def test_open_r1_images_in_every_form_are_read_and_placed_before_the_question(tmp_path):
    red, green, blue = png((255, 0, 0)), png((0, 255, 0)), png((0, 0, 255), (2, 2))
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "g.png").write_bytes(green)
    solution = "<think>Count them.</think>\n\n<answer>3</answer>"
    rows = [
        # the parquet struct, its bytes as base64 text in JSONL
        {
            "image": {"bytes": base64.b64encode(red).decode(), "path": None},
            "problem": "How many?",
            "solution": solution,
        },
        {"image": {"bytes": None, "path": "imgs/g.png"}, "problem": "How many?", "solution": solution},
        {"image": "imgs/g.png", "problem": "q", "solution": solution},  # a path, relative to the file
        {
            "image": "data:image/png;base64," + base64.b64encode(blue).decode(),
            "problem": "q",
            "solution": "4",
        },
        {"image": ["imgs/g.png", {"bytes": base64.b64encode(red).decode()}], "problem": "q", "solution": "4"},
    ]
    path = write_jsonl(tmp_path / "open_r1.jsonl", rows)
    got = records(path, prompt_key="problem", label_key="solution", image_key="image")
    assert [r.images for r in got] == [(red,), (green,), (green,), (blue,), (green, red)]
    assert got[0].answer == solution
    assert got[0].messages == [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many?"}]}
    ]
    assert got[4].messages[0]["content"][:2] == [{"type": "image"}, {"type": "image"}]
    assert decode(got[3].images[0]).size == (2, 2) and decode(got[3].images[0]).getpixel((0, 0)) == (
        0,
        0,
        255,
    )


def test_image_markers_place_the_images_and_must_match_their_count(tmp_path):
    img = base64.b64encode(png((1, 2, 3))).decode()
    prompt = [{"role": "user", "content": "<image>\nWhat is shown?"}]
    row = {
        "prompt": prompt,
        "images": [{"bytes": img}],
        "reward_model": {"ground_truth": "<answer>A</answer>"},
    }
    path = write_jsonl(tmp_path / "converted.jsonl", [row, {**row, "images": [{"bytes": img}] * 2}])
    keys = {"label_key": "reward_model.ground_truth", "image_key": "images"}
    reader = read_records(path, prompt_key="prompt", **keys)
    first = next(reader)
    assert first.messages[0]["content"] == [{"type": "image"}, {"type": "text", "text": "\nWhat is shown?"}]
    with pytest.raises(DatasetError, match=rf"{path}:2: the prompt marks 1 image\(s\) but the row holds 2"):
        next(reader)


def test_a_text_task_keeps_image_markers_as_text_and_refuses_image_parts(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "a <image> tag", "label": "1"}])
    assert records(path)[0].messages[0]["content"] == "a <image> tag"
    parts = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "q"}]}]
    path = write_jsonl(tmp_path / "parts.jsonl", [{"prompt": parts, "label": "1"}])
    with pytest.raises(
        DatasetError, match=rf"{path}:1: the prompt has image parts but task.image_key is not set"
    ):
        records(path)


@pytest.mark.parametrize(
    ("row", "keys", "message"),
    [
        (
            {"question": "q", "label": "1"},
            {},
            r":2: no key 'prompt' \(the row's keys: \['label', 'question'\]\)\. Fix: task.prompt_key=",
        ),
        (
            dapo_row(1),
            {"label_key": "reward_model.answer"},
            r":2: no key 'reward_model.answer'.*Fix: task.label_key=",
        ),
        ({"prompt": "q", "label": None}, {}, r":2: 'label' \(task.label_key\) is null"),
        ({"prompt": 5, "label": "1"}, {}, r":2: the prompt \(task.prompt_key\) must be a string or a list"),
        ({"prompt": [{"content": "q"}], "label": "1"}, {}, r":2: the prompt .* must be a string or a list"),
        ({"prompt": "q", "label": {"a": 1}}, {}, r":2: the answer \(task.label_key='label'\) must be text"),
        ({"prompt": "q", "label": "1"}, {"image_key": "image"}, r":2: no key 'image'.*Fix: task.image_key="),
        (
            {"prompt": "q", "label": "1", "image": "missing.png"},
            {"image_key": "image"},
            r":2: image 0: image file .*missing.png does not exist",
        ),
        (
            {
                "prompt": "q",
                "label": "1",
                "image": ["ok.png", {"bytes": base64.b64encode(b"not an image").decode()}],
            },
            {"image_key": "image"},
            r":2: image 1: not a decodable image",
        ),
        (
            {"prompt": "q", "label": "1", "image": {"bytes": base64.b64encode(b"not an image").decode()}},
            {"image_key": "image"},
            r":2: image 0: not a decodable image",
        ),
        (
            {"prompt": "q", "label": "1", "image": {"bytes": "%%%"}},
            {"image_key": "image"},
            r":2: image 0: image text is neither a path nor valid base64",
        ),
        (
            {"prompt": "q", "label": "1", "image": {"path": None}},
            {"image_key": "image"},
            r":2: image 0: an image struct with neither",
        ),
        (
            {"prompt": "q", "label": "1", "image": 7},
            {"image_key": "image"},
            r":2: image 0: int is not an image",
        ),
    ],
)
def test_a_bad_row_is_one_error_naming_the_file_the_row_and_the_key(tmp_path, row, keys, message):
    """Row 1 is fine for every key set; row 2 is the bad one."""
    fine = {"prompt": "fine", "label": "1", "reward_model": {"answer": "1"}, "image": "ok.png"}
    path = write_jsonl(tmp_path / "bad.jsonl", [fine, row])
    (tmp_path / "ok.png").write_bytes(png((9, 9, 9)))
    keys = {"label_key": "label", **keys}
    with pytest.raises(DatasetError, match=rf"^{path}{message}"):
        records(path, **keys)


def test_a_file_that_is_not_json_lines_names_its_line(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"prompt": "q", "label": "1"}\n\n{"prompt": \n')
    with pytest.raises(DatasetError, match=rf"^{path}:3: not a JSON line"):
        records(path)
    path.write_text('["q", "1"]\n')
    with pytest.raises(DatasetError, match=rf"^{path}:1: a row must be a JSON object, got list"):
        records(path)


def test_only_local_jsonl_and_parquet_files_are_datasets(tmp_path):
    with pytest.raises(
        DatasetError,
        match="task.dataset='BytedTsinghua-SIA/DAPO-Math-17k' is not a local file; skyq never downloads",
    ):
        local_file("BytedTsinghua-SIA/DAPO-Math-17k", key="task.dataset")
    with pytest.raises(DatasetError, match="task.eval.dataset is not set"):
        local_file(None, key="task.eval.dataset")
    csv = tmp_path / "aime.csv"
    csv.write_text("problem,answer\n")
    with pytest.raises(
        DatasetError, match=r"task.eval.dataset=.*aime.csv': skyq reads .jsonl and .parquet files, not '.csv'"
    ):
        local_file(str(csv), key="task.eval.dataset")
    assert local_file(str(write_jsonl(tmp_path / "a.jsonl", [])), key="task.dataset") == tmp_path / "a.jsonl"


def test_parquet_without_pyarrow_is_refused_naming_the_fix(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    path = tmp_path / "dapo-math-17k.parquet"
    path.write_bytes(b"PAR1")
    with pytest.raises(
        DatasetError, match=rf"^{path}: reading parquet needs pyarrow, which is not installed"
    ):
        records(path)


def test_parquet_files_in_the_seed_layouts_read_as_their_jsonl_twins(tmp_path):
    """The datasets' own parquet files: DAPO-Math-17k's struct answer, open-r1's image struct of raw bytes
    (the form `datasets` writes an Image column in)."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [dapo_row(i) for i in range(5)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "dapo.parquet", row_group_size=2)
    write_jsonl(tmp_path / "dapo.jsonl", rows)
    keys = {"label_key": "reward_model.ground_truth"}
    from_parquet, from_jsonl = (
        records(tmp_path / "dapo.parquet", **keys),
        records(tmp_path / "dapo.jsonl", **keys),
    )
    assert [(r.messages, r.answer) for r in from_parquet] == [(r.messages, r.answer) for r in from_jsonl]
    assert from_parquet[4].where == f"{tmp_path / 'dapo.parquet'} row 4"

    image = png((10, 20, 30))
    open_r1 = [
        {"image": {"bytes": image, "path": "x.png"}, "problem": "How many?", "solution": "<answer>2</answer>"}
    ]
    pq.write_table(pa.Table.from_pylist(open_r1), tmp_path / "open_r1.parquet")
    (record,) = records(
        tmp_path / "open_r1.parquet", prompt_key="problem", label_key="solution", image_key="image"
    )
    assert record.images == (image,) and record.answer == "<answer>2</answer>"
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DatasetError, match="bad.parquet: not a readable parquet file"):
        records(tmp_path / "bad.parquet")
