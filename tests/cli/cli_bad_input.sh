#!/usr/bin/env bash
# Table-driven bad-input test of the CLI: every case must exit with code 2
# and print exactly one line, starting with "error:", on stderr.
set -uo pipefail
: "${HPMOE:?}" "${HPMOE_SOURCE_DIR:?}"
tmp=$(mktemp -d); [ -n "${KEEP_TMP:-}" ] || trap 'rm -rf "$tmp"' EXIT; [ -n "${KEEP_TMP:-}" ] && echo "$tmp"
trace="$HPMOE_SOURCE_DIR/data/routing/mixtral-8x7b/coding.json"
echo '{"0": [[0, 9], [1, 2]]}' > "$tmp/out_of_range.json"
echo '{"0": [[0, 1], [1, 2' > "$tmp/truncated.json"
echo '{"0": [[0, 1, 2]]}' > "$tmp/wide.json"
echo '{"foo": 1}' > "$tmp/unknown_format.json"
echo '{"hidden_size": "big", "moe_intermediate_size": 8, "num_experts": 8, "num_experts_per_tok": 2}' > "$tmp/bad_type.json"
echo '{"hidden": 32, "expert_inter": 16, "routed_experts": 6, "top_k": 2, "ranks": 8}' > "$tmp/fewer_experts.json"
# Placements of the tiny preset's 8 experts on 2 ranks that cannot be run.
echo '{"experts_of_rank": [[0, 1, 2], [3, 4, 5, 6]]}' > "$tmp/place_nowhere.json"
echo '{"experts_of_rank": [[0, 1, 2, 3], [3, 4, 5, 6, 7]]}' > "$tmp/place_twice.json"
echo '{"experts_of_rank": [[0, 1, 2, 3, 4], [4, 5, 6, 7]], "replicas": true, "fetch_replicas": 1}' > "$tmp/fetch_bool.json"
echo '{"experts_of_rank": [[0, 1, 2, 3], [4, 5, 6, 7]], "fetch_replicas": true}' > "$tmp/fetch_alone.json"
echo '{"experts_of_rank": [[0, 1, 2, 3, 4], [4, 5, 6, 7]], "replicas": true, "owners": [0, 0, 0, 0, 1, 1, 1, 0]}' > "$tmp/owner_not_home.json"
echo '{"experts_of_rank": [[0, 1, 2, 3, 4], [4, 5, 6, 7]], "replicas": true, "owners": [0, 0]}' > "$tmp/owners_short.json"
echo '{"owner": [0, 0, 0, 0, 1, 1, 1, 1], "owners": [0, 0, 0, 0, 1, 1, 1, 1]}' > "$tmp/owners_with_owner.json"
echo '{"experts_of_rank": [[0, 1, 2], [3, 4, 5], [6, 7]]}' > "$tmp/place_missing_rank.json"
echo '{"owner": [0, 0, 0, 0, 1, 1, 1, 5]}' > "$tmp/place_owner_missing_rank.json"
echo '{"experts_of_rank": [[0, 1, 2, 3, 4, 5, 6, 9], [7]]}' > "$tmp/place_no_such_expert.json"
echo '{"experts_of_rank": [[0, 1, 2, 3, 4, 5, 6, 7], []]}' > "$tmp/place_empty_rank.json"
echo '{"experts_of_rank": [[0, 1, 2, 3], [4, 5, 6, 7]], "owner": [0, 0, 0, 0, 1, 1, 1, 1]}' > "$tmp/place_both.json"
echo '{"experts_of_rank": [[0, 1, 2, 3], [4, 5, 6, "7"]]}' > "$tmp/place_string.json"
printf 'garbage' > "$tmp/garbage.json"
# JSON nested 100,000 levels deep (a stack overflow once), a number past double, a directory as a file.
python3 -c "print('{\"hidden\": ' + '[' * 100000 + ']' * 100000 + '}')" > "$tmp/deep.json"
python3 -c "print('{\"0\": ' + '[' * 3000 + ']' * 3000 + '}')" > "$tmp/deep_trace.json"
echo '{"hidden": 1e400}' > "$tmp/huge_number.json"
mkdir -p "$tmp/a_directory"
echo 'not a folder' > "$tmp/a_file"
echo '{"hidden": 64}' > "$tmp/missing_keys.json"  # an hpmoe config without expert_inter, routed_experts, top_k
echo '{"hidden": 64, "expert_inter": 18446744073709551615, "routed_experts": 8, "top_k": 2}' > "$tmp/u64_field.json"
echo '{"hidden_size": 18446744073709551615, "moe_intermediate_size": 8, "num_experts": 8, "num_experts_per_tok": 2}' > "$tmp/u64_hf.json"
# Issue 59: the layer and how it runs in sections; a run field under "layer", a section beside them.
echo '{"layer": {"hidden": 64, "expert_inter": 32, "routed_experts": 8, "top_k": 2, "ranks": 4}}' > "$tmp/misplaced_field.json"
echo '{"layer": {"hidden": 64, "expert_inter": 32, "routed_experts": 8, "top_k": 2}, "runs": {}}' > "$tmp/stray_section.json"
# FIFOs given as inputs (each would block open() until a writer came) and
# as an output nobody reads; a checkpoint index that is a directory.
"$HPMOE" config --preset tiny > "$tmp/tiny_config.json"
mkfifo "$tmp/fifo.json"
mkdir -p "$tmp/fifo_single" "$tmp/fifo_index" "$tmp/fifo_shard" "$tmp/index_dir/model.safetensors.index.json"
mkfifo "$tmp/fifo_single/weights.safetensors" "$tmp/fifo_index/model.safetensors.index.json" "$tmp/fifo_shard/w.safetensors"
echo '{"weight_map": {"mlp.gate.weight": "w.safetensors"}}' > "$tmp/fifo_shard/model.safetensors.index.json"
mkdir -p "$tmp/save_blocked/outputs.safetensors"  # --save would have to replace a directory with a file
# Replicas: over the slot budget, one rank listing an expert twice, a replica
# losing an expert, a budget that is not a positive integer.
echo '{"experts_of_rank": [[0, 1, 2, 3, 4], [4, 5, 6, 7]], "replicas": true, "slots_per_rank": 4}' > "$tmp/place_over_budget.json"
# Issue 58: every expert on every one of 16 ranks (the replicas' gradients did not count in run's estimate);
# a u64 expert id; a config that an output would overwrite; a sweep folder holding one of its inputs.
python3 -c 'import json, sys; json.dump({"experts_of_rank": [list(range(64))] * 16, "replicas": True}, open(sys.argv[1], "w"))' \
  "$tmp/all_replicated.json"
echo '{"experts_of_rank": [[0, 1, 2, 3], [4, 5, 6, 18446744073709551615]]}' > "$tmp/place_u64.json"
"$HPMOE" config --preset tiny > "$tmp/in_and_out.json"
mkdir -p "$tmp/sweep_in" && echo '{"hidden": 64}' > "$tmp/sweep_in/sweep.json"
echo '{"experts_of_rank": [[0, 1, 2, 3, 3], [4, 5, 6, 7]], "replicas": true}' > "$tmp/place_twice_on_rank.json"
echo '{"experts_of_rank": [[0, 1, 2, 4], [4, 5, 6, 7]], "replicas": true}' > "$tmp/place_replica_loses.json"
echo '{"experts_of_rank": [[0, 1, 2, 3], [4, 5, 6, 7]], "slots_per_rank": 0}' > "$tmp/place_zero_budget.json"
echo '{"experts_of_rank": [[0, 1, 2, 3], [4, 5, 6, 7]], "replicas": "yes"}' > "$tmp/place_replicas_string.json"
# Tensor-parallel splits (the tiny preset's expert_inter is 16): parts that
# do not tile the intermediate dimension, a part without a rank, a split
# mixed with replicas, a malformed split.
echo '{"experts_of_rank": [[0, 1, 2, 3], [0, 4, 5, 6, 7]], "splits": [{"expert": 0, "columns": [0, 8, 20]}]}' > "$tmp/split_too_wide.json"
echo '{"experts_of_rank": [[0, 1, 2, 3], [0, 4, 5, 6, 7]], "splits": [{"expert": 0, "columns": [0, 8, 8, 16]}]}' > "$tmp/split_empty_part.json"
echo '{"experts_of_rank": [[0, 1, 2, 3], [4, 5, 6, 7]], "splits": [{"expert": 0, "columns": [0, 8, 16]}]}' > "$tmp/split_one_rank.json"
echo '{"experts_of_rank": [[0, 1, 2, 3], [0, 4, 5, 6, 7]], "splits": [{"expert": 0, "columns": [4, 8, 16]}]}' > "$tmp/split_gap.json"
echo '{"experts_of_rank": [[0, 1, 2, 3], [0, 4, 5, 6, 7]], "splits": [{"expert": 0, "cols": [0, 8, 16]}]}' > "$tmp/split_bad_key.json"
echo '{"experts_of_rank": [[0, 1, 2, 3], [0, 4, 5, 6, 7]], "splits": [{"expert": 0, "columns": [0, 8, 16]}], "slots_per_rank": 4}' > "$tmp/split_over_budget.json"
# A cut at an odd column: fine in fp32, not in bf16 (its kernels take K in pairs).
echo '{"experts_of_rank": [[0, 1, 2, 3], [0, 4, 5, 6, 7]], "splits": [{"expert": 0, "columns": [0, 7, 16]}]}' > "$tmp/split_odd.json"
python3 -c "import json; m=json.load(open('$HPMOE_SOURCE_DIR/machines/h800.json')); del m['links']; json.dump(m, open('$tmp/nolinks.json', 'w'))"
python3 -c "import json; m=json.load(open('$HPMOE_SOURCE_DIR/machines/h800.json')); m['units']['matrix'] = -3; json.dump(m, open('$tmp/negunits.json', 'w'))"
# Machine figures outside any machine's range (the simulation's times would be inf or NaN).
python3 - "$HPMOE_SOURCE_DIR/machines/h800.json" "$tmp" <<'PY'
import json, sys
src, tmp = sys.argv[1], sys.argv[2]
for name, path, value in [("m_latency", ("signal_latency_s",), 1e308), ("m_overhead", ("task_overhead_s",), 1e300),
                          ("m_issue", ("put", "issue_s"), 1e308), ("m_bandwidth", ("links", "intra", "bytes_per_s"), 1e-300),
    ("m_weight_rows", ("tile", "weight_rows"), 0), ("m_weight_cols", ("tile", "weight_cols"), 300),
    # issue 16's fields: put engines, their bounds, link rates by EP, baselines
    ("m_engine", ("put", "engine"), "pigeon"), ("m_in_flight", ("put", "in_flight"), 1.5),
    ("m_receive", ("put", "receive"), {"per_put_s": 1e-6, "bytes_per_s": 1e9}),
    ("m_by_ep", ("links", "intra", "by_ep"), [{"ranks": 16, "bytes_per_s": 1e11}, {"ranks": 8, "bytes_per_s": 1e11}]),
    ("m_sm", ("serialized", "matrix_units"), -1), ("m_fp8", ("baselines", "deepep", "fp8_dispatch"), "yes"),
    ("m_host_sync", ("baselines", "mindspore", "host_sync_s"), -1),
    ("m_ser_overhead", ("serialized", "task_overhead_s"), -1e-6), ("m_stream", ("put", "stream_per_peer"), True),
    # vector kinds at their own rates: a matrix kind, and a rate that is not one
    ("m_by_kind", ("vector", "by_kind"), {"gemm_down": 1e10}), ("m_by_kind_rate", ("vector", "by_kind"), {"swiglu": "fast"}),
    # a misspelt field (its figure would silently not be used), a control character in the name
    ("m_unknown", ("units", "matrx"), 8), ("m_unknown_top", ("link",), {"intra": {}}),
    ("m_name_control", ("name",), "h800\u001b[31m"),
    # the memory per rank (issue 42): not a number, negative, beyond any device
    ("m_memory_string", ("memory", "bytes_per_rank"), "80GB"), ("m_memory_negative", ("memory", "bytes_per_rank"), -1),
    ("m_memory_huge", ("memory", "bytes_per_rank"), 1e300),
    # GEMM efficiency (issue 42): above the peak, beside a FLOP/s figure, without the peak it is a share of
    ("m_efficiency", ("matrix", "tile_rates", 0, "efficiency"), 1.5),
    ("m_efficiency_and_rate", ("matrix", "tile_rates", 0, "bf16_flops"), 1e12),
    ("m_no_peak", ("matrix", "peak"), None)]:
    m = json.load(open(src))
    d = m
    for k in path[:-1]: d = d[k] if isinstance(k, int) else d.setdefault(k, {})
    if value is None: del d[path[-1]]
    else: d[path[-1]] = value
    json.dump(m, open(f"{tmp}/{name}.json", "w"))
PY
"$HPMOE" run --save "$tmp/saved" > /dev/null
# Checkpoints and inputs holding NaN or Inf (refused at load, naming the tensor).
"$HPMOE" run --set expert_bias=true --set scoring=sigmoid --save "$tmp/nan_base" > /dev/null
python3 - "$tmp" <<'PY'
import json, os, shutil, struct, sys
tmp = sys.argv[1]
def poison(name, file, tensor, value):
    shutil.copytree(f"{tmp}/nan_base", f"{tmp}/{name}")
    path = os.path.join(tmp, name, file)
    b = bytearray(open(path, "rb").read())
    n = struct.unpack("<Q", b[:8])[0]
    off = 8 + n + json.loads(b[8:8 + n])[tensor]["data_offsets"][0] + 12
    b[off:off + 4] = struct.pack("<f", value)
    open(path, "wb").write(b)
poison("nan_bias", "weights.safetensors", "mlp.gate.e_score_correction_bias", float("nan"))
poison("inf_x", "inputs.safetensors", "x", float("inf"))
poison("nan_weight", "weights.safetensors", "mlp.experts.2.up_proj.weight", float("nan"))
poison("nan_dout", "inputs.safetensors", "d_out", float("-inf"))
PY
# Program dumps whose placement or buffer fields are malformed.
"$HPMOE" compile -P 2 --pass backward --routing uniform --placement round-robin --dump "$tmp/dump.json" > /dev/null
python3 - "$tmp" <<'PY'
import json, sys
tmp = sys.argv[1]
def mutate(name, fn):
    j = json.load(open(f"{tmp}/dump.json"))
    fn(j["programs"][1])
    json.dump(j, open(f"{tmp}/{name}.json", "w"))
mutate("dump_expert_range", lambda p: p["local_experts"].__setitem__(0, 99))
mutate("dump_expert_twice", lambda p: p["local_experts"].__setitem__(1, p["local_experts"][0]))
mutate("dump_kpad_length", lambda p: p["kpad_begin"].pop())
mutate("dump_region", lambda p: p["buffers"][0].__setitem__("region", "elsewhere"))
mutate("dump_layout", lambda p: p["buffers"][0].__setitem__("layout", "diagonal"))
mutate("dump_elem_bytes", lambda p: p["dims"].__setitem__("elem_bytes", 3))
mutate("dump_experts", lambda p: p["dims"].__setitem__("experts", 0))
# Integers past int32 (read as 64-bit and range-checked, never truncated),
# a negative layer size, a rectangle whose end overflows, the dump's version.
mutate("dump_rows_u32", lambda p: p["tasks"][0].__setitem__(6, 4294967296 + 3))
mutate("dump_hidden_negative", lambda p: p["dims"].__setitem__("hidden", -5))
mutate("dump_src_row_overflow", lambda p: p["tasks"][0].__setitem__(9, 2**31 - 1))
mutate("dump_rank_huge", lambda p: p.__setitem__("rank", 2**40))
# Events, queues, expert lists, buffers read at 64 bits: 2^32 + 2 is not 2.
mutate("dump_event_u32", lambda p: p["events"][0].__setitem__(0, 2**32 + 2))
mutate("dump_event_tile_u32", lambda p: p["events"][0].__setitem__(3, 2**32))
mutate("dump_queue_u32", lambda p: p["queues"][0].__setitem__(0, 2**32 + 1))
mutate("dump_local_expert_u32", lambda p: p["local_experts"].__setitem__(0, 2**32))
mutate("dump_buffer_rows_u64", lambda p: p["buffers"][0].__setitem__("rows", 2**64 - 1))
mutate("dump_expert_begin_str", lambda p: p["expert_begin"].__setitem__(0, "0"))
j = json.load(open(f"{tmp}/dump.json")); j["version"] = 99; json.dump(j, open(f"{tmp}/dump_version.json", "w"))
PY
# Sharded checkpoints (model.safetensors.index.json) that cannot be read.
mkdir -p "$tmp/idx_json" "$tmp/idx_nomap" "$tmp/idx_escape" "$tmp/idx_missing" "$tmp/idx_two_layers"
printf '{"weight_map": ' > "$tmp/idx_json/model.safetensors.index.json"
echo '{"metadata": {}}' > "$tmp/idx_nomap/model.safetensors.index.json"
echo '{"weight_map": {"mlp.gate.weight": "../../etc/passwd"}}' > "$tmp/idx_escape/model.safetensors.index.json"
echo '{"weight_map": {"mlp.gate.weight": "absent.safetensors"}}' > "$tmp/idx_missing/model.safetensors.index.json"
echo '{"weight_map": {"model.layers.1.mlp.gate.weight": "a.safetensors", "model.layers.2.mlp.gate.weight": "a.safetensors"}}' \
  > "$tmp/idx_two_layers/model.safetensors.index.json"
# safetensors files that break the format's layout: overlapping tensors,
# offsets that are not integers, bytes after the last tensor, a size that
# does not match the dtype and shape.
python3 - "$tmp" <<'PY'
import json, shutil, struct, sys
tmp = sys.argv[1]
def rewrite(name, fn, tail=b""):
    shutil.copytree(f"{tmp}/saved", f"{tmp}/{name}")
    path = f"{tmp}/{name}/weights.safetensors"
    b = open(path, "rb").read()
    n = struct.unpack("<Q", b[:8])[0]
    header = json.loads(b[8:8 + n])
    fn(header)
    head = json.dumps(header).encode()
    open(path, "wb").write(struct.pack("<Q", len(head)) + head + b[8 + n:] + tail)
def second(h):
    return sorted((v["data_offsets"][0], k) for k, v in h.items() if k != "__metadata__")[1][1]
def overlap(h):
    k = second(h); size = h[k]["data_offsets"][1] - h[k]["data_offsets"][0]
    h[k]["data_offsets"] = [0, size]
rewrite("st_overlap", overlap)
rewrite("st_float_offsets", lambda h: h[second(h)].__setitem__("data_offsets", [float(x) for x in h[second(h)]["data_offsets"]]))
rewrite("st_trailing", lambda h: None, tail=b"junk after the tensors")
rewrite("st_dtype_size", lambda h: h[second(h)].__setitem__("dtype", "F64"))
PY
mkdir -p "$tmp/badst" && printf '\x10\x00\x00\x00\x00\x00\x00\x00{"x": 1}' > "$tmp/badst/weights.safetensors"

cases=(
  "run --load $tmp/st_overlap"
  "run --load $tmp/st_float_offsets"
  "run --load $tmp/st_trailing"
  "run --load $tmp/st_dtype_size"
  "config --config $tmp/a_directory"
  "config --config $tmp/missing_keys.json"
  "config --config $tmp/u64_field.json"
  "config --config $tmp/u64_hf.json"
  "config --config $tmp/misplaced_field.json"
  "config --config $tmp/stray_section.json"
  "run --routing trace:$trace:-1"
  "run --routing trace:"
  "run --routing zipf:1e308"
  "run --routing zipf:"
  "run --routing hot:"
  "run --seed -1"
  "run --seed 1e23"
  "run --seed 18446744073709551616"
  "run --check-every 0"
  "run --routing mixed:3"
  "simulate --machine h800 --seed -5"
  # fp8 GEMM rates (issue 42, item 4): a bf16 layer on a machine that has them
  "simulate --machine h800 --gemm-dtype fp4"
  "simulate --machine h800 --gemm-dtype fp8"
  "simulate --machine ascend-a3 --dtype bf16 --gemm-dtype fp8"
  "step --machine ascend-a3 --layers 2 --dtype bf16 --gemm-dtype fp8"
  "sweep --machine h800,ascend-a3 --model tiny -P 2 -T 64 --dtype bf16 --gemm-dtype fp8 --out $tmp/sw"
  "sweep --machine h800 --model tiny -P 2 -T 64 --gemm-dtype fp8 --out $tmp/sw"
  "simulate --machine $tmp/m_efficiency.json"
  "simulate --machine $tmp/m_efficiency_and_rate.json"
  "simulate --machine $tmp/m_no_peak.json"
  # hpmoe step (issue 42, item 2)
  "step --machine h800"
  "step --layers 4"
  "step --machine h800 --layers 0"
  "step --machine h800 --layers 4 --dense-layers 5"
  "step --machine h800 --layers 4 -T 1"
  "step --machine h800 --layers 4 --comm-share 1"
  "step --machine h800 --layers 4 --comm-share nan"
  "step --machine h800 --layers 4 --attention-ms -1"
  "step --machine h800 --layers 4 --attention-ms nan"
  "step --machine h800 --layers 4 --dense-ms nan"
  "step --machine h800 --layers 4 --attention-params nan"
  "step --machine h800 --layers 4 --attention-params 0"
  "step --machine h800 --layers 4 --other-ms nan"
  "step --machine h800 --layers 4 --seq-len 0"
  "step --machine h800 --layers 4 --dense-inter 0"
  "step --machine h800 --layers 4 --json /nonexistent/dir/step.json"
  "step --machine h800 --layers 4 --chart /nonexistent/dir/step.svg"
  "step --machine h800 --layers 4 --json $tmp/same.out --chart $tmp/same.out"
  "step --machine h800 --layers 4 --routing zipf:-1"
  "step --machine nosuchmachine --layers 4"
  "step --machine h800 --layers 4 --schedule nope"
  # hpmoe sweep (issue 42, item 5)
  "sweep --machine h800 --model tiny -P 2 -T 64"
  "sweep --model tiny -P 2 -T 64 --out $tmp/sw"
  "sweep --machine h800,nosuchmachine --model tiny -P 2 -T 64 --out $tmp/sw"
  "sweep --machine h800 --model nosuchmodel -P 2 -T 64 --out $tmp/sw"
  "sweep --machine h800 --model tiny -P 2,16 -T 64 --out $tmp/sw"
  "sweep --machine h800 --model tiny -P 0 -T 64 --out $tmp/sw"
  "sweep --machine h800 --model tiny -P 2 -T 0 --out $tmp/sw"
  "sweep --machine h800 --model tiny -P 2 -T 64 --routing zipf:9 --out $tmp/sw"
  "sweep --machine h800 --model tiny -P 2 -T 64 --schedule nope --out $tmp/sw"
  "sweep --machine h800 --model tiny -P 2 -T 64 --vary put.nope=1 --out $tmp/sw"
  "sweep --machine h800 --model tiny -P 2 -T 64 --vary put.in_flight=abc --out $tmp/sw"
  "sweep --machine h800 --model tiny -P 2 -T 64 --vary put.in_flight=-1 --out $tmp/sw"
  "sweep --machine h800 --model tiny -P 2 -T 64 --vary put.in_flight= --out $tmp/sw"
  "sweep --machine h800 --model tiny -P 2 -T 64 --vary put.in_flight=4,,8 --out $tmp/sw"
  "sweep --machine h800 --model tiny -P 2 -T 64 --vary put=1 --out $tmp/sw"
  "sweep --machine h800 --model tiny -P 2 -T 64 --vary nodots --out $tmp/sw"
  "sweep --machine h800 --model tiny -P 2 -T 64 --dense-layers 1 --out $tmp/sw"
  # Issue 58: a grid past the cap is refused before it is built (64 million points took 6 GB first); a field
  # varied twice; a value refused at parse time, not in its result row; an output over an input.
  "sweep --machine h800 --model tiny -P 2 -T 64 --vary put.in_flight=$(seq -s, 1 400) --vary vector.bytes_per_s=$(seq -s, 1 400) --out $tmp/sw"
  "sweep --machine h800 --model tiny -P 2 -T 64 --vary put.in_flight=1 --vary put.in_flight=2 --out $tmp/sw"
  "sweep --machine h800 --model deepseek-v3 -P 256 -T 8192,16384,32768 --backward -j 3 --out $tmp/sw"
  "sweep --machine h800 --model tiny -P 2 -T 64 --vary put.in_flight=1,x --out $tmp/sw"
  "sweep --machine h800 --model $tmp/sweep_in/sweep.json -P 2 -T 64 --out $tmp/sweep_in"
  "compile --config $tmp/in_and_out.json --json $tmp/in_and_out.json"
  "compile --config $tmp/in_and_out.json --dump $tmp/in_and_out.json"
  "run --placement $tmp/place_u64.json"
  # Memory refused before it is taken: lent weights and replicas count in run's estimate; simulate refuses a
  # layer its machine cannot hold before it builds any program (it took minutes at millions of tokens).
  "run -P 16 --set hidden=2048 --set expert_inter=1024 --set routed_experts=64 -T 64 --backward --lend 1 --verify off"
  "run -P 16 --set hidden=2048 --set expert_inter=1024 --set routed_experts=64 -T 64 --backward --placement $tmp/all_replicated.json --verify off"
  "simulate --machine h800 --preset deepseek-v3 -P 8 -T 4000000 --backward"
  "sweep --machine h800 --model tiny -P 2 -T 1 --layers 2 --out $tmp/sw"
  "sweep --machine h800 --model tiny -P 2 -T 64 --set top_k=100 --out $tmp/sw"
  "sweep --machine h800 --model tiny -P 2 -T 64 -j 0 --out $tmp/sw"
  "sweep --machine h800 --model tiny -P 2 -T 64 --out $tmp/a_file"
  "sweep --machine h800 --model tiny -P 2 -T 64 --out $tmp/a_file/sw"
  "sweep --machine h800 --model tiny -P 2 -T 64 --dtype fp16 --out $tmp/sw"
  "sweep --machine h800 --model tiny -P 2 -T 64 --dispatch-dtype fp4 --out $tmp/sw"
  "sweep --machine h800 --model tiny -P 2 -T 64 --exchange nope --out $tmp/sw"
  "sweep --machine h800 --model tiny -P 2 -T 64 --combine-dtype fp4 --out $tmp/sw"
  "sweep --machine h800 --model tiny -P 2 -T 64 --placement $tmp/nowhere.json --out $tmp/sw"
  "sweep --machine h800 --model tiny -P 2 -T 64 --seed -1 --out $tmp/sw"
  "step --machine h800 --layers 2 --attention-width 0"
  "step --machine h800 --layers 2 --seed -1"
  "step --machine h800 --layers 2 --placement $tmp/nowhere.json"
  "run --preset nope"
  "run --preset tiny --config $tmp/unknown_format.json"
  "run --set top_k=100"
  "run --set routed_experts=6 --ranks 8"
  "run --placement $tmp/place_nowhere.json"
  "run --placement $tmp/place_twice.json"
  "run --placement $tmp/place_missing_rank.json"
  "run --placement $tmp/place_owner_missing_rank.json"
  "run --placement $tmp/place_no_such_expert.json"
  "run --placement $tmp/place_empty_rank.json"
  "run --placement $tmp/place_both.json"
  "run --placement $tmp/place_string.json"
  "run --placement $tmp/garbage.json"
  "run --placement /nonexistent/placement.json"
  "run --placement random:x"
  "run --placement $tmp/place_over_budget.json"
  "run --placement $tmp/place_twice_on_rank.json"
  "run --placement $tmp/place_replica_loses.json"
  "run --placement $tmp/place_zero_budget.json"
  "run --placement $tmp/place_replicas_string.json"
  "run --placement $tmp/split_too_wide.json"
  "run --placement $tmp/split_empty_part.json"
  "run --placement $tmp/split_one_rank.json"
  "run --placement $tmp/split_gap.json"
  "run --placement $tmp/split_bad_key.json"
  "run --placement $tmp/split_over_budget.json"
  "compile --placement $tmp/split_too_wide.json"
  "simulate --machine $HPMOE_SOURCE_DIR/machines/h800.json --placement $tmp/split_too_wide.json"
  "compile --placement $tmp/place_twice.json"
  "simulate --machine $HPMOE_SOURCE_DIR/machines/h800.json --placement $tmp/place_nowhere.json"
  "run --set groups=3"
  "run --set hidden=0"
  "run --set hidden=abc"
  "run --set nofield=1"
  "run --set hidden"
  "run --set tokens_per_rank=-5"
  "run --set route_scale=inf"
  "run --set route_scale=1e300"
  "simulate --machine h800 -P 4096 --set routed_experts=4096 -T 1"
  "config --config $tmp/deep.json"
  "run --routing trace:$tmp/deep_trace.json"
  "config --config $tmp/huge_number.json"
  "config --config $tmp/a_directory"
  "simulate --machine $tmp/a_directory"
  "run --placement $tmp/deep.json"
  "verify $tmp/deep.json"
  "simulate --machine $tmp/m_latency.json --backward"
  "simulate --machine $tmp/m_overhead.json --backward"
  "simulate --machine $tmp/m_issue.json"
  "simulate --machine $tmp/m_bandwidth.json"
  "simulate --machine $tmp/m_weight_rows.json"
  "simulate --machine $tmp/m_weight_cols.json"
  "run --set z_loss_coef=1e308"
  "run --dtype fp16"
  "run --dtype bf16 --set hidden=33"
  "run --dispatch-dtype fp4"
  "run --dispatch-dtype fp8"
  "run --dtype bf16 --dispatch-dtype fp32"
  "simulate --machine $HPMOE_SOURCE_DIR/machines/h800.json --set hidden=96 --dispatch-dtype fp8"
  "run --set grad_dispatch_dtype=fp8"
  "run --exchange node"
  "run --set exchange="
  "run --ranks 4 --exchange rank --set ranks_per_node=3"
  "run --ranks 2 --set ranks_per_node=4"
  "run --set ranks_per_node=-1"
  "run --set ranks_per_node=two"
  "run --set node_forwarding=maybe"
  "simulate --machine h800 -P 16 --set routed_experts=64 --exchange rank --set ranks_per_node=4"
  "run --combine-dtype fp8"
  "run --combine-dtype bf16"
  "run --set combine_dtype=half --exchange rank"
  "run --lend"
  "run --placement $tmp/fetch_bool.json"
  "run --placement $tmp/fetch_alone.json"
  "run --placement $tmp/owner_not_home.json"
  "run --placement $tmp/owners_short.json"
  "run --placement $tmp/owners_with_owner.json"
  "run --lend maybe"
  "run --lend 0"
  "run --lend -4"
  "run --lend 1e3"
  "run --lend 99999999999"
  "run --set lend_weights=-2"
  "run --set lend_weights=many"
  "simulate --machine h800 --lend sometimes"
  "sweep --machine h800 --model tiny -P 2 -T 64 --lend auto,half --out $tmp/sw"
  "run --ranks 0"
  "run --tokens abc"
  "run --workers 0"
  "run --iters -1"
  "run --iters abc"
  "run --bogus-flag"
  "run --verify maybe"
  "run --mode sideways"
  "run --schedule random"
  "run --transport carrier-pigeon"
  "run --mpi-path shared"
  "run --transport mpi --mpi-path telepathy"
  "run --inject-fault explode:1"
  "run --inject-fault exit:7"
  "run --watchdog 0"
  "run --peer-timeout 0"
  "run --transport mpi --mpi-path shared --inject-fault stall:x"
  "run --mode interleaved --schedule fill -W 0"
  "run --machine h800"
  "run --exchange auto --machine nowhere"
  "compile --exchange auto"
  "compile --dispatch-dtype auto"
  "run --dispatch-dtype auto"
  "simulate --machine h800 --preset tiny -P 2 -T 8 --routing grouped"
  "run --routing bogus"
  "run --routing zipf:abc"
  "run --routing hot:0.9"
  "run --routing trace:/nonexistent/trace.json"
  "run --routing trace:$trace:99"
  "run --routing trace:$trace --set top_k=3"
  "run --routing trace:$tmp/out_of_range.json"
  "run --routing trace:$tmp/truncated.json"
  "run --routing trace:$tmp/wide.json"
  "run --config /nonexistent/config.json"
  "run --config $tmp/garbage.json"
  "run --config $tmp/unknown_format.json"
  "run --config $tmp/bad_type.json"
  "run --config $tmp/fewer_experts.json"
  "run --load /nonexistent/dir"
  "run --load $tmp/saved --set hidden=64"
  "run --load $tmp/badst"
  "run --load $tmp/idx_json"
  "run --load $tmp/idx_nomap"
  "run --load $tmp/idx_escape"
  "run --load $tmp/idx_missing"
  "run --load $tmp/idx_two_layers"
  "run --load $tmp/saved:no.such.prefix."
  "run --check-inprocess"
  "run --verify-all-ranks"
  "run --count-exchange sideways"
  "run --mpi-outbox 0"
  "run --mpi-outbox lots"
  "run --json /nonexistent/dir/out.json"
  "run --trace /nonexistent/dir/trace.json"
  "run --timeline /nonexistent/dir/timeline.svg"
  "compile --machine gpu:4"
  "compile --machine cpu:0"
  "compile --machine cpu:2:64"
  "compile --schedule random"
  "compile --pass sideways"
  "compile -P 2 --rank 5"
  "compile --routing bogus"
  "compile --preset deepseek-v3 -P 64 -T 4096"
  "verify /nonexistent/prog.json"
  "verify $tmp/garbage.json"
  "verify $tmp/unknown_format.json"
  "verify $tmp/truncated.json"
  "verify"
  "verify $tmp/dump_expert_range.json"
  "verify $tmp/dump_rows_u32.json"
  "run --set expert_bias=true --set scoring=sigmoid --load $tmp/nan_bias"
  "run --set expert_bias=true --set scoring=sigmoid --load $tmp/inf_x"
  "run --set expert_bias=true --set scoring=sigmoid --load $tmp/nan_weight"
  "run --set expert_bias=true --set scoring=sigmoid --backward --load $tmp/nan_dout"
  "verify $tmp/dump_hidden_negative.json"
  "verify $tmp/dump_src_row_overflow.json"
  "verify $tmp/dump_rank_huge.json"
  "verify $tmp/dump_event_u32.json"
  "verify $tmp/dump_event_tile_u32.json"
  "verify $tmp/dump_queue_u32.json"
  "verify $tmp/dump_local_expert_u32.json"
  "verify $tmp/dump_buffer_rows_u64.json"
  "verify $tmp/dump_expert_begin_str.json"
  "verify $tmp/dump_version.json"
  "verify $tmp/dump_expert_twice.json"
  "verify $tmp/dump_kpad_length.json"
  "verify $tmp/dump_region.json"
  "verify $tmp/dump_layout.json"
  "verify $tmp/dump_elem_bytes.json"
  "verify $tmp/dump_experts.json"
  "simulate"
  "plan --machine nosuchmachine"
  "plan --steps 0"
  "plan -P 2 --slots-per-rank 2"
  "plan --routing hot:0.9"
  "plan --out /nonexistent/dir/placement.json"
  "plan --placement $tmp/place_over_budget.json"
  "simulate --machine nosuchmachine"
  "simulate --machine $tmp/garbage.json"
  "simulate --machine $tmp/nolinks.json"
  "simulate --machine $tmp/negunits.json"
  "simulate --machine $tmp/m_engine.json"
  "simulate --machine $tmp/m_unknown.json"
  "simulate --machine $tmp/m_memory_string.json"
  "simulate --machine $tmp/m_memory_negative.json"
  "simulate --machine $tmp/m_memory_huge.json"
  # A layer whose rank cannot hold its weights and buffers in the machine's memory (issue 42, item 3).
  "simulate --machine h800 --preset deepseek-v3 -P 8 -T 65536 --backward"
  "simulate --machine $tmp/m_unknown_top.json"
  "simulate --machine $tmp/m_name_control.json"
  "simulate --machine $tmp/m_in_flight.json"
  "simulate --machine $tmp/m_receive.json"
  "simulate --machine $tmp/m_by_ep.json"
  "simulate --machine $tmp/m_sm.json"
  "simulate --machine $tmp/m_fp8.json"
  "simulate --machine $tmp/m_host_sync.json"
  "simulate --machine $tmp/m_ser_overhead.json"
  "simulate --machine $tmp/m_stream.json"
  "simulate --machine $tmp/m_by_kind.json"
  "simulate --machine $tmp/m_by_kind_rate.json"
  "simulate --machine ascend-a3 --kernel-scope=maybe"
  "simulate --machine $HPMOE_SOURCE_DIR/machines/h800.json -W 2"
  "simulate --machine $HPMOE_SOURCE_DIR/machines/h800.json --set routed_experts=7 -P 8"
  "simulate --machine $HPMOE_SOURCE_DIR/machines/h800.json --routing trace:$tmp/out_of_range.json"
  "calibrate --out /nonexistent/dir/m.json --quick"
  "calibrate -W 0"
  "run --dtype bf16 --placement $tmp/split_odd.json"
  "compile --dtype bf16 --placement $tmp/split_odd.json"
  "simulate --machine h800 --dtype bf16 --placement $tmp/split_odd.json"
  # A recording shorter than a step (2 x 8192 tokens against 12,138) is not repeated unasked.
  "simulate --machine h800 -T 8192 --routing trace:$trace:3"
  "run -T 8192 --routing trace:$trace:3 --iters 1"
  # Memory that cannot be had: refused with one line before it is taken
  # (a no-swap machine would otherwise OOM-kill the process).
  "calibrate -W 256 --quick"
  "run -T 4194304 --set hidden=256"
  "run -T 4194304 --set hidden=256 --mode interleaved --verify off"
  "simulate --machine $HPMOE_SOURCE_DIR/machines/h800.json --schedule random"
  "simulate --machine $HPMOE_SOURCE_DIR/machines/h800.json --dtype fp8"
  "config --preset nope"
  "config --set top_k=0"
  "nosuchcommand"
  ""
  # Outputs that cannot be written: a full device, a directory, a missing
  # directory (found before the run, which can take minutes).
  "run --json /dev/full"
  "simulate --machine $HPMOE_SOURCE_DIR/machines/h800.json --json /dev/full"
  "compile --json /dev/full"
  "compile --pass both --dump $tmp/no/such/dir/dump.json"
  "run --json $tmp"
  "config --config $tmp/fifo.json"
  "run --placement $tmp/fifo.json"
  "run --routing trace:$tmp/fifo.json"
  "simulate --machine $tmp/fifo.json"
  "verify $tmp/fifo.json"
  "plan --machine h800 --routing trace:$tmp/fifo.json"
  "run --load $tmp/fifo_single"
  "run --load $tmp/fifo_index"
  "run --load $tmp/fifo_shard"
  "run --load $tmp/index_dir"
  "run --json $tmp/fifo.json"
  # Outputs that would overwrite each other, the save, or an input.
  "run --json $tmp/same.json --trace $tmp/same.json"
  "run --save $tmp --json $tmp/weights.safetensors"
  "run --save $tmp --trace $tmp/model.safetensors.index.json"
  "run --config $tmp/tiny_config.json --json $tmp/tiny_config.json"
  "simulate --machine h800 --json $tmp/s.json --timeline $tmp/./s.json"
  "plan --machine h800 --out $tmp/p.json --json $tmp/p.json"
  "run --save $tmp/save_blocked"
  "run --trace $tmp/no/such/dir/t.json"
  "plan --machine h800 --out $tmp/no/such/dir/p.json"
  "calibrate --quick --out $tmp/no/such/dir/m.json"
)
failed=0
for c in "${cases[@]}"; do
  # shellcheck disable=SC2086
  timeout 120 "$HPMOE" $c > "$tmp/stdout" 2> "$tmp/stderr"  # 124: a hang
  rc=$?
  lines=$(wc -l < "$tmp/stderr")
  if [ "$rc" -ne 2 ] || [ "$lines" -ne 1 ] || ! grep -q '^error: ' "$tmp/stderr"; then
    echo "FAIL: hpmoe $c -> exit $rc, $lines stderr lines:"; sed 's/^/    /' "$tmp/stderr"
    failed=$((failed + 1))
  fi
done
# Threads that cannot all be started (a memory or pids limit) stop the run
# with an error, not a hang. (Not under AddressSanitizer, whose shadow memory
# needs more address space than the limit.)
if [ -z "${ASAN_OPTIONS:-}" ]; then
  (ulimit -v 1500000; timeout 60 "$HPMOE" run -P 2 -W 256 -T 2 --no-pin > /dev/null 2> "$tmp/stderr")
  rc=$?
  if [ "$rc" -ne 2 ] || ! grep -q '^error: could not start worker thread' "$tmp/stderr"; then
    echo "FAIL: hpmoe run -W 256 under ulimit -v -> exit $rc"; sed 's/^/    /' "$tmp/stderr"; failed=$((failed + 1))
  fi
fi
# Values that the table cannot hold (split on spaces): an empty -T, a newline
# inside a flag's value (still one error line).
one_line_error() {  # one_line_error ARGS...: exit 2 and exactly one "error:" line
  "$HPMOE" "$@" > /dev/null 2> "$tmp/stderr"
  local rc=$?
  if [ "$rc" -ne 2 ] || [ "$(wc -l < "$tmp/stderr")" -ne 1 ] || ! grep -q '^error: ' "$tmp/stderr"; then
    echo "FAIL: hpmoe $* -> exit $rc"; sed 's/^/    /' "$tmp/stderr"; failed=$((failed + 1))
  fi
}
one_line_error run -T ""
one_line_error run --preset "$(printf 'tiny\nfoo')"
# A layer name that is not printable ASCII (it goes into reports and JSON).
"$HPMOE" run --set name=$'\xff' > /dev/null 2> "$tmp/stderr"
rc=$?
if [ "$rc" -ne 2 ] || ! grep -q '^error: invalid layer: name' "$tmp/stderr"; then
  echo "FAIL: hpmoe run --set name=\\xff -> exit $rc"; failed=$((failed + 1))
fi
# Standard output that cannot be written is an error too.
"$HPMOE" config --preset tiny > /dev/full 2> "$tmp/stderr"
rc=$?
if [ "$rc" -ne 2 ] || ! grep -q '^error: cannot write to standard output' "$tmp/stderr"; then
  echo "FAIL: hpmoe config > /dev/full -> exit $rc"; failed=$((failed + 1))
fi
# SIGTERM at any moment of a run with --save leaves complete files or none,
# and no temporaries (the atomic writer removes them on the signal).
for delay in 0.3 0.8 1.5; do
  rm -rf "$tmp/killed"
  "$HPMOE" run --set hidden=512 --set expert_inter=512 -T 512 --mode serialized --verify off --save "$tmp/killed" > /dev/null 2>&1 &
  pid=$!
  sleep "$delay"; kill -TERM "$pid" 2> /dev/null; wait "$pid" 2> /dev/null
  if ls "$tmp/killed"/*.partial-* > /dev/null 2>&1 || ! python3 - "$tmp/killed" <<'PY'
import glob, json, os, struct, sys
for path in glob.glob(os.path.join(sys.argv[1], "*.safetensors")):
    b = open(path, "rb").read()
    n = struct.unpack("<Q", b[:8])[0]
    end = max(v["data_offsets"][1] for k, v in json.loads(b[8:8 + n]).items() if k != "__metadata__")
    sys.exit(f"{path}: truncated") if len(b) != 8 + n + end else None
PY
  then
    echo "FAIL: SIGTERM after ${delay}s of run --save left a partial file"; ls -la "$tmp/killed"; failed=$((failed + 1))
  fi
done
# HPMOE_BF16_ENGINE, read once by the first bf16 tile: a value it does not
# know is one line naming the variable, exit 2.
HPMOE_BF16_ENGINE=bogus "$HPMOE" run --preset tiny -P 2 -T 16 --dtype bf16 --iters 1 --warmup 0 > /dev/null 2> "$tmp/stderr"
rc=$?
if [ "$rc" -ne 2 ] || [ "$(wc -l < "$tmp/stderr")" -ne 1 ] || ! grep -q "^error: HPMOE_BF16_ENGINE='bogus'" "$tmp/stderr"; then
  echo "FAIL: HPMOE_BF16_ENGINE=bogus run --dtype bf16 -> exit $rc"; cat "$tmp/stderr"; failed=$((failed + 1))
fi
# A successful write leaves the file and no temporary beside it.
"$HPMOE" simulate --machine h800 --preset tiny --json "$tmp/sim.json" > /dev/null
if [ ! -s "$tmp/sim.json" ] || ls "$tmp"/sim.json.partial* > /dev/null 2>&1; then
  echo "FAIL: simulate --json left no file or a temporary"; failed=$((failed + 1))
fi
echo "bad input: $((${#cases[@]} + 10 - failed)) passed, $failed failed"
[ "$failed" -eq 0 ]
