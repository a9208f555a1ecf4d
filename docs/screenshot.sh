#!/usr/bin/env bash
# `make docs-screenshot`: the built FTStrategy reference page (site/, from `make docs`) in Debian's headless Chromium,
# saved as docs/img/api-ftstrategy.png (or the path given). site/ is served on loopback on a port the server picks
# itself (port 0), and the server is stopped by its PID afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
out=$(realpath -m "${1:-docs/img/api-ftstrategy.png}")
chromium=$(command -v chromium || command -v chromium-browser || true)
if [ -z "$chromium" ]; then
    echo "docs/screenshot.sh needs Chromium: apt-get install -y chromium" >&2
    exit 1
fi
if [ ! -f site/reference/strategy.html ]; then
    echo "docs/screenshot.sh: no built site; run make docs first" >&2
    exit 1
fi

log=$(mktemp)
profile=$(mktemp -d)
"$python" -u -m http.server 0 --bind 127.0.0.1 --directory site >"$log" 2>&1 &
server=$!
cleanup() {
    kill "$server" 2>/dev/null || true
    wait "$server" 2>/dev/null || true
    rm -rf "$log" "$profile"
}
trap cleanup EXIT

port=""
for _ in $(seq 100); do  # "Serving HTTP on 127.0.0.1 port 40123 (http://127.0.0.1:40123/) ..."
    port=$(sed -n 's/^Serving HTTP on .* port \([0-9][0-9]*\) .*/\1/p' "$log")
    [ -n "$port" ] && break
    sleep 0.1
done
if [ -z "$port" ]; then
    echo "docs/screenshot.sh: the HTTP server did not start:" >&2
    cat "$log" >&2
    exit 1
fi

url="http://127.0.0.1:$port/reference/strategy.html"
mkdir -p "$(dirname "$out")"
rm -f "$out"
"$chromium" --headless --no-sandbox --disable-gpu --disable-quic --no-first-run --disable-background-networking \
    --disable-component-update --disable-sync --hide-scrollbars --user-data-dir="$profile" --window-size=1280,1600 \
    --screenshot="$out" "$url" >"$profile/chromium.log" 2>&1 || true
if [ ! -s "$out" ]; then
    echo "docs/screenshot.sh: Chromium wrote no screenshot of $url:" >&2
    cat "$profile/chromium.log" >&2
    exit 1
fi
echo "$url -> ${out#"$PWD"/}"
