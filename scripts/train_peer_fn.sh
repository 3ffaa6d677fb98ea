# Sourced by the training GPU scripts (gpu_optim.sh, gpu_mhc_train.sh, gpu_train_graphs.sh); needs $OUT and $PY.
# peer NAME LIMIT_S ARGS...: one benchmarks/train_peer.py run (no long contexts), its log in $OUT/NAME.log and its
# JSON under $OUT/NAME; prints the return code and the log's table.
peer() {
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$PY" benchmarks/train_peer.py --contexts --out "$OUT/$name" "$@" > "$OUT/$name.log" 2>&1
  echo "--- $name (rc $?)"; grep -v Warning "$OUT/$name.log" | tail -n 4
}
