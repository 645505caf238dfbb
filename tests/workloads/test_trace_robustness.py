"""Malformed traces and outputs: one-line ``file:line`` errors (exit 2), never an internal error,
a silently wrong value or a replaced special file (the trace robustness scan's findings)."""

import json
import math
import os
import stat

import pytest
from pydantic import ValidationError
from servesim.simulator.cli import main
from servesim.simulator.errors import ConfigError, ServesimError, TraceError
from servesim.workloads import build_workload
from servesim.workloads.cli import write_canonical
from servesim.workloads.config import TraceWorkload
from servesim.workloads.importers import detect_format, read_trace
from servesim.workloads.schema import RequestSpec

AZ_HEAD = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
AZ = AZ_HEAD + "2023-11-16 18:17:03.9799600,4808,10\n2023-11-16 18:17:04.0319600,300,8\n"


def cli(capsys, *args) -> tuple[int, str]:
    """(exit code, stdout + stderr) of ``simulate ARGS``."""
    try:
        main(list(map(str, args)))
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, (out.out + out.err).strip()


def error(path, **kw) -> str:
    with pytest.raises(TraceError) as e:
        list(read_trace(path, **kw))
    return str(e.value)


def mooncake(write, *lines, name="m.jsonl"):
    return write(name, "".join(line + "\n" for line in lines))


GOOD_MC = '{"timestamp": 0, "input_length": 100, "output_length": 5}'


# 1. convert --overwrite never renames over a FIFO, device node or symlink


def test_convert_refuses_an_output_that_is_not_a_regular_file(write, tmp_path, capsys):
    src = write("a.csv", AZ)
    fifo = tmp_path / "f.csv"
    os.mkfifo(fifo)
    target = write("keep.csv", "precious\n")
    link = tmp_path / "link.csv"
    link.symlink_to(target)
    dangling = tmp_path / "dangling.csv"
    dangling.symlink_to(tmp_path / "nowhere.csv")
    for out, kind in ((fifo, "a FIFO"), (link, "a symlink"), (dangling, "a symlink")):
        for extra in ([], ["--overwrite"]):
            msg = (f"error: {out}: exists and is {kind}, not a regular file; expected a new "
                   "or regular file name")
            assert cli(capsys, "trace", "convert", src, "-o", out, *extra) == (2, msg)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert link.is_symlink() and target.read_text() == "precious\n"
    assert dangling.is_symlink() and not (tmp_path / "nowhere.csv").exists()
    names = ["a.csv", "dangling.csv", "f.csv", "keep.csv", "link.csv"]
    assert sorted(p.name for p in tmp_path.iterdir()) == names  # no temp file left
    # a regular file is still replaced with --overwrite
    reg = write("reg.csv", "old\n")
    assert cli(capsys, "trace", "convert", src, "-o", reg, "--overwrite")[0] == 0
    assert reg.read_text().startswith("arrival_s,")


def test_write_canonical_checks_again_before_the_rename(tmp_path):
    # the output became a symlink after check_output_file: still never renamed over
    target = tmp_path / "keep.csv"
    target.write_text("precious\n")
    link = tmp_path / "out.csv"
    link.symlink_to(target)
    with pytest.raises(ServesimError, match="exists and is a symlink, not a regular file"):
        write_canonical(iter([RequestSpec(0.0, 10, 2)]), link)
    assert link.is_symlink() and target.read_text() == "precious\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.csv", "out.csv"]


# 2. huge / typo timestamps


def test_reader_refuses_an_arrival_far_from_the_first_request(write, capsys):
    typo = write("y.csv", AZ.replace("2023-11-16 18:17:04", "2203-11-16 18:17:04"))
    msg = ("arrival 5.6802e+09 s after the first request is out of range (at most "
           "100,000,000 s, about 3.2 years): a typo in the timestamp?")
    assert cli(capsys, "trace", "stats", typo) == (2, f"error: {typo}:3: {msg}")
    assert error(write("c.csv", "arrival_s,prompt_len,output_len\n0,100,10\n1e300,200,20\n")
                 ).endswith("c.csv:3: arrival 1e+300 s after the first request is out of range "
                            "(at most 100,000,000 s, about 3.2 years): a typo in the timestamp?")
    mc = mooncake(write, GOOD_MC, '{"timestamp": 1e308, "input_length": 9, "output_length": 5}')
    assert "m.jsonl:2: arrival 1e+305 s after the first request is out of range" in error(mc)
    # skippable; the bound itself is accepted (offsets from the first request, any time base)
    st = {}
    assert len(list(read_trace(typo, skip_bad_rows=True, stats=st))) == 1
    assert st["skipped_bad_rows"] == 1
    ok = write("ok.csv", "arrival_s,prompt_len,output_len\n1e9,100,10\n1.1e9,200,20\n")
    assert [r.arrival_s for r in read_trace(ok)] == [1e9, 1.1e9]


def test_rescaling_past_the_arrival_bound_is_a_config_error(write):
    p = write("a.csv", AZ)
    for kw, at in (({"request_rate": 1e-300}, "1e+300"), ({"time_scale": 1e10}, "5.2e+08")):
        with pytest.raises(ConfigError) as e:
            list(build_workload(TraceWorkload(path=str(p), **kw), block_size=16))
        assert str(e.value) == (f"workload.{next(iter(kw))}: stretches {p} to an arrival at "
                                f"{at} s (at most 100,000,000 s, about 3.2 years)")
    sg = write("s.json", json.dumps([{"prompt_len": 10, "output_len": 9}] * 3))
    with pytest.raises(ConfigError, match=r"workload\.request_rate: stretches .* to an arrival"):
        list(build_workload(TraceWorkload(path=str(sg), request_rate=1e-300), block_size=16))


def test_stats_json_is_strict_json():
    from servesim.workloads.cli import _strict_json

    assert _strict_json({"a": math.nan, "b": {"c": math.inf, "d": -math.inf}, "e": 1.5}) == {
        "a": None, "b": {"c": "inf", "d": "-inf"}, "e": 1.5}


# 3. malformed JSON values: one line, exit 2, skippable per line


@pytest.mark.parametrize("line,msg", [
    ('{"timestamp": 0, "input_length": Infinity, "output_length": 5}',
     "m.jsonl:2: expected an integer input_length, got inf"),
    ('{"timestamp": 0, "input_length": 1e400, "output_length": 5}',
     "m.jsonl:2: expected an integer input_length, got inf"),
    ('{"timestamp": 0, "input_length": ' + "1" * 5000 + ', "output_length": 5}',
     ("m.jsonl:2: expected a JSON object (Exceeds the limit (4300 digits) for integer string "
      "conversion), got '{\"timestamp\": 0, \"input_length\": 1111111'")),
    ('{"timestamp": 0, "input_length": 9, "output_length": 5, "x": ' + "[" * 100000
     + "]" * 100000 + "}",
     ("m.jsonl:2: expected a JSON object (nested too deeply), got "
      "'{\"timestamp\": 0, \"input_length\": 9, \"out'")),
    ('{"timestamp": 0, "input_length": 9, "output_length": 5, "hash_ids": [9223372036854775808]}',
     ("m.jsonl:2: hash_ids entry 9223372036854775808 is too large (at most "
      "8,303,511,812,964,351)")),
])
def test_mooncake_malformed_values(write, capsys, line, msg):
    p = mooncake(write, GOOD_MC, line)
    code, out = cli(capsys, "trace", "stats", p)
    assert (code, out) == (2, f"error: {p.parent}/{msg}")
    st = {}
    assert len(list(read_trace(p, skip_bad_rows=True, stats=st))) == 1
    assert st["skipped_bad_rows"] == 1


def test_mooncake_bad_first_record_is_still_detected(write):
    p = mooncake(write, '{"timestamp": 0, "input_length": ' + "1" * 5000
                 + ', "output_length": 5}', GOOD_MC)
    assert detect_format(p) == "mooncake"
    assert "m.jsonl:1: expected a JSON object (Exceeds the limit (4300 digits)" in error(p)


@pytest.mark.parametrize("doc,msg", [
    ({"input_lens": 5, "output_lens": 5},
     "input_lens: expected a list (one entry per request), got int 5"),
    ({"input_lens": {"a": 1}, "output_lens": {"b": 2}},
     "input_lens: expected a list (one entry per request), got dict {'a': 1}"),
    ({"input_lens": [1, 2], "output_lens": [3, 4], "errors": 5},
     "errors: expected a list (one entry per request), got int 5"),
    ({"input_lens": [1, 2], "output_lens": [3, 4], "start_times": {"0": 1}},
     "start_times: expected a list (one entry per request), got dict {'0': 1}"),
    ({"input_lens": [1, 2], "output_lens": [3, 4], "errors": "boom"},
     "errors: expected a list (one entry per request), got str 'boom'"),
    ({"input_lens": [1, 2], "output_lens": [3, 4], "start_times": "abc"},
     "start_times: expected a list (one entry per request), got str 'abc'"),
    ({"input_lens": [1, 2], "output_lens": [3, 4], "errors": [""]},
     "errors: expected 2 entries (one per input_lens entry), got 1"),
    ({"input_lens": [1, 2], "output_lens": [3]},
     "output_lens: expected 2 entries (one per input_lens entry), got 1"),
    ({"input_lens": [1, 2], "output_lens": [3, 4], "start_times": [0, "1"]},
     "start_times: expected a list of numbers, got '1'"),
    ({"input_lens": [100.9, 50], "output_lens": [10, 3]},
     "request 0: expected an integer input_lens entry, got 100.9"),
    ({"input_lens": ["100", 50], "output_lens": [10, 3]},
     "request 0: expected an integer input_lens entry, got the string '100'"),
])
def test_vllm_result_malformed_fields(write, capsys, doc, msg):
    p = write("r.json", json.dumps(doc))
    assert cli(capsys, "trace", "stats", "--format", "vllm_result", p) == (
        2, f"error: {p}: {msg}")


# 4. canonical -> canonical keeps the other columns


def test_convert_canonical_keeps_extra_columns(write, tmp_path, capsys):
    p = write("c.csv", "arrival_s,prompt_len,output_len,alpha,note\n0,100,10,0.9,x\n"
                       "1,200,20,,y\n")
    out = tmp_path / "o.csv"
    assert cli(capsys, "trace", "convert", p, "-o", out) == (0, f"wrote 2 requests to {out}")
    lines = out.read_text().splitlines()
    assert lines[0].endswith(",request_id,alpha,note")
    assert lines[1].endswith(",0.9,x") and lines[2].endswith(",,y")
    assert [r.extra for r in read_trace(out)] == [{"alpha": 0.9, "note": "x"}, {"note": "y"}]


# 5. duplicate header columns


@pytest.mark.parametrize("text,col", [
    ("arrival_s,prompt_len,output_len,prompt_len\n0,100,10,5\n", "prompt_len"),
    (("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type,Request tokens\n"
      "5,ChatGPT,100,2,102,Conversation log,999\n"), "Request tokens"),
    (AZ_HEAD.strip() + ",GeneratedTokens\n2023-11-16 18:17:03.9799600,4808,10,3\n",
     "GeneratedTokens"),
])
def test_duplicate_header_column(write, capsys, text, col):
    p = write("d.csv", text)
    assert cli(capsys, "trace", "stats", p) == (2, f"error: {p}:1: duplicate column {col!r}")


# 6. non-finite time_scale / start_s


@pytest.mark.parametrize("key", ["time_scale", "start_s"])
def test_time_scale_and_start_s_must_be_finite(key):
    with pytest.raises(ValidationError, match="Input should be a finite number"):
        TraceWorkload(path="x.csv", **{key: math.inf})
    assert TraceWorkload(path="x.csv", end_s=math.inf).end_s == math.inf  # no end


# 7. a window with no request


def test_empty_time_window_names_the_window_and_span(write):
    p = write("a.csv", AZ_HEAD + "".join(
        f"2023-11-16 18:17:{s:02d}.0000000,100,10\n" for s in (0, 10, 30)))
    for kw, win in (({"start_s": 100}, "[100, inf)"), ({"start_s": 11, "end_s": 20}, "[11, 20)"),
                    ({"start_s": 11, "end_s": 20, "sample": 1}, "[11, 20)")):
        with pytest.raises(ConfigError) as e:
            list(build_workload(TraceWorkload(path=str(p), **kw), block_size=16))
        assert str(e.value) == (f"workload.start_s/end_s: no request of {p} arrives in {win} s "
                                "(the trace spans 0-30 s)")
    r = list(build_workload(TraceWorkload(path=str(p), start_s=5, end_s=20), block_size=16))
    assert [x.arrival_s for x in r] == [0.0]


# 8. parent_id / request_id


@pytest.mark.parametrize("rows,msg", [
    ("0,100,10,a,zzz\n", "c.csv:2: parent_id 'zzz' names no request in the trace"),
    ("0,100,10,a,\n1,100,10,b,zzz\n2,100,10,c,a\n",
     "c.csv:3: parent_id 'zzz' names no request in the trace"),
    ("0,100,10,a,a\n", "c.csv:2: parent_id 'a' names the request itself"),
    ("0,100,10,a,\n0,100,10,a,\n", "c.csv:3: duplicate request_id 'a' (first at line 2)"),
])
def test_canonical_parent_and_request_ids(write, rows, msg):
    p = write("c.csv", "arrival_s,prompt_len,output_len,request_id,parent_id\n" + rows)
    assert error(p) == f"{p.parent}/{msg}"


def test_canonical_parents_named_ahead_or_by_position_are_kept(write):
    p = write("c.csv", "arrival_s,prompt_len,output_len,request_id,parent_id\n"
                       "0,100,10,a,b\n0,100,10,b,\n1,100,10,,\n2,100,10,d,2\n")
    assert [r.parent_id for r in read_trace(p)] == ["b", None, None, "2"]
    dup = write("d.csv", "arrival_s,prompt_len,output_len,request_id\n0,1,1,a\n0,1,1,a\n")
    assert "d.csv:3: duplicate request_id 'a' (first at line 2)" in error(dup)


# 9. JSON lengths: integers only, numbers only


@pytest.mark.parametrize("value,shown", [("1000.5", "1000.5"), ('"1000"', "the string '1000'"),
                                         ("true", "True")])
def test_json_lengths_must_be_integral_numbers(write, value, shown):
    p = mooncake(write, GOOD_MC, f'{{"timestamp": 0, "input_length": {value}, '
                                 '"output_length": 5}')
    assert error(p).endswith(f"m.jsonl:2: expected an integer input_length, got {shown}")
    p = mooncake(write, GOOD_MC, '{"timestamp": 0, "input_length": 1000.0, "output_length": 5}')
    assert [r.prompt_len for r in read_trace(p)] == [100, 1000]
    s = write("s.json", json.dumps([{"prompt_len": 10.5, "output_len": 9}]))
    assert error(s, format="sharegpt").endswith(
        "s.json: entry 0: expected an integer prompt_len, got 10.5")


# 10. Mooncake hash ids never wrap


def test_mooncake_hash_ids_too_large_are_refused(write):
    p = mooncake(write, '{"timestamp": 0, "input_length": 600, "output_length": 5, '
                        '"hash_ids": [0]}',
                 '{"timestamp": 1, "input_length": 600, "output_length": 5, '
                 '"hash_ids": [36028797018963968]}')
    assert error(p).endswith("m.jsonl:2: hash_ids entry 36028797018963968 is too large "
                             "(at most 8,303,511,812,964,351)")
    ok = p.read_text().replace("36028797018963968", "8303511812964351")
    r = list(read_trace(mooncake(write, *ok.splitlines(), name="ok.jsonl"), block_size=16))
    assert set(r[0].prefix_block_ids).isdisjoint(r[1].prefix_block_ids)
    assert max(r[1].prefix_block_ids) < 2**62


# 11, 12. convert: non-UTF-8 .json, unknown --format


def test_convert_non_utf8_json_is_a_clean_error(tmp_path, capsys):
    p = tmp_path / "s.json"
    p.write_bytes(b'[{"conversations": [{"value": "caf\xe9 au lait"}, {"value": "yes"}]}]')
    code, msg = cli(capsys, "trace", "convert", p, "-o", tmp_path / "o.csv")
    assert (code, msg) == (2, f"error: {p}: invalid UTF-8 bytes: expected a UTF-8 text file")


def test_convert_unknown_format(write, tmp_path, capsys):
    p = write("a.csv", AZ)
    out = tmp_path / "new" / "o.csv"
    msg = (f"error: {p}: unknown trace format 'bogus' (one of canonical, azure2023, azure2024, "
           "burstgpt, mooncake, sharegpt, vidur, vllm_result, inference-perf, guidellm, aiperf, "
           "genai-perf)")
    assert cli(capsys, "trace", "convert", p, "-o", out, "--format", "bogus") == (2, msg)
    assert not out.parent.exists()


# 13. ShareGPT: dropped entries counted, positions in the file, Mooncake arrays


def test_sharegpt_counts_dropped_entries_and_names_file_positions(write):
    conv = {"conversations": [{"value": "x" * 40}, {"value": "y" * 40}]}
    p = write("s.json", json.dumps([conv, {"conversations": [{"value": "one turn"}]},
                                    {"foo": 1}, [1, 2], "str", conv]))
    st = {}
    assert len(list(read_trace(p, stats=st))) == 2 and st["filtered"] == 4
    mixed = write("m.json", json.dumps([{"prompt_len": 100, "output_len": 50}] + [conv] * 5))
    st = {}
    assert len(list(read_trace(mixed, stats=st))) == 1 and st["filtered"] == 5
    bad = {"conversations": [{"value": "x" * 40}, {"value": 12}]}
    pos = write("p.json", json.dumps([conv] * 4 + [bad] + [conv] * 2))
    assert error(pos) == f"{pos}: entry 4: expected conversations[0..1] with string 'value'"
    only_bad = write("b.json", json.dumps([{"foo": 1}, "str"]))
    assert error(only_bad) == f"{only_bad}: empty trace: no requests (2 filtered out, 0 failed " \
                              "rows dropped)"


def test_mooncake_records_in_a_json_array(write):
    p = write("a.json", json.dumps([json.loads(GOOD_MC)]))
    with pytest.raises(TraceError) as e:
        detect_format(p)
    assert str(e.value) == (f"{p}: a JSON array of Mooncake records; expected JSONL (one JSON "
                            "object per line), or set workload.format")


# 14. convert says what it dropped or changed


def test_convert_reports_every_counter(write, tmp_path, capsys):
    b = write("b.csv", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                       "5,ChatGPT,10,2,12,Conversation log\n6,GPT-4,100,0,100,Conversation log\n")
    out = tmp_path / "o.csv"
    assert cli(capsys, "trace", "convert", b, "-o", out) == (
        0, f"wrote 1 requests to {out} (1 failed requests dropped)")
    z = write("z.csv", AZ.replace("4808,10", "4808,0").replace("300,8", "x,8"))
    assert cli(capsys, "trace", "convert", z, "-o", out, "--overwrite", "--skip-bad-rows") == (
        0, f"wrote 1 requests to {out} (1 bad rows skipped, 1 zero output lengths set to 1)")


# 16-18. format detection and odd numbers


def test_mooncake_with_u2028_in_its_first_record_is_detected(write):
    p = mooncake(write, json.dumps({**json.loads(GOOD_MC), "note": "a\u2028b"},
                                   ensure_ascii=False), GOOD_MC)
    assert detect_format(p) == "mooncake" and len(list(read_trace(p))) == 2


def test_azure_extra_header_columns_are_ignored(write):
    p = write("a.csv", AZ_HEAD.strip() + ",Region\n2023-11-16 18:17:03.9799600,4808,10,eu\n"
                                         "2023-11-16 18:17:04.0000000,300,8\n")
    assert error(p).endswith("a.csv:3: expected 4 fields (TIMESTAMP,ContextTokens,"
                             "GeneratedTokens,Region), got 3")
    st = {}
    assert [r.prompt_len for r in read_trace(p, skip_bad_rows=True, stats=st)] == [4808]


@pytest.mark.parametrize("cell", ["1_000", "\u0663\u0660\u0660"])
def test_odd_integer_spellings_are_refused(write, cell):
    p = write("a.csv", AZ.replace("300,8", f"{cell},8"))
    assert error(p).endswith(f"a.csv:3: expected an integer ContextTokens, got {cell!r}")


def test_gzip_data_without_gz_suffix(tmp_path):
    import gzip

    p = tmp_path / "t.csv"
    p.write_bytes(gzip.compress(AZ.encode()))
    with pytest.raises(TraceError) as e:
        detect_format(p)
    assert str(e.value) == f"{p}: gzip data; name the file *.gz to read it through gzip"


def test_failed_convert_leaves_no_new_folder(write, tmp_path, capsys):
    p = write("a.csv", AZ.replace("300,8", "x,8"))
    out = tmp_path / "new" / "sub" / "o.csv"
    assert cli(capsys, "trace", "convert", p, "-o", out) == (
        2, f"error: {p}:3: expected an integer ContextTokens, got 'x'")
    assert not (tmp_path / "new").exists()
    assert cli(capsys, "trace", "convert", p, "-o", out, "--skip-bad-rows")[0] == 0
    assert out.is_file()


def test_vidur_row_with_an_extra_field(write):
    p = write("v.csv", "arrived_at,num_prefill_tokens,num_decode_tokens\n0,100,10,garbage\n")
    assert error(p) == (f"{p}:2: expected 3 fields (arrived_at,num_prefill_tokens,"
                        "num_decode_tokens), got 4")


def test_canonical_rows_with_very_long_prefix_ids_read_back(tmp_path):
    """A long shared prompt at block size 16 writes a prefix_block_ids field of more than the
    csv module's default 131,072 characters (a converted Mooncake conversation trace has one
    of 143,256): it reads back."""
    from servesim.workloads import build_workload
    from servesim.workloads.config import TraceWorkload

    ids = " ".join(str(i) for i in range(30_000))  # 168,889 characters
    assert len(ids) > 131_072
    p = tmp_path / "long.csv"
    p.write_text(f"arrival_s,prompt_len,output_len,prefix_block_ids\n0,480000,4,{ids}\n")
    (req,) = list(build_workload(TraceWorkload(path=str(p)), block_size=16))
    assert req.prompt_len == 480000 and len(req.prefix_block_ids) == 30_000
