#!/usr/bin/env bash
# bench/ckpt.sh — a gpt2-124m checkpoint's write and read speed against the disk's, timed
# in the same run on the same filesystem (the checkpoint directory's).
#
# Each of ROUNDS rounds (default 3), in this order, so a noisy neighbour hits all:
#   1. the disk's sequential write: dd of as many bytes as the checkpoint's three data files
#      hold, 8 MiB writes, O_DIRECT (oflag=direct) and then through the page cache, each
#      ended by an fsync (conv=fsync);
#   2. the checkpoint: `ferry train --model gpt2-124m --steps 1 --checkpoint-sync` into an
#      empty directory; its "ckpt" line gives the save's seconds (everything: the state
#      fetched block by block, the files written, fsynced, renamed), the files' bytes are
#      counted here;
#   3. the disk's sequential read: the three files, evicted from the page cache first, read
#      with dd (8 MiB, O_DIRECT), then (evicted again) through the page cache (readahead);
#   4. resuming from it (files evicted again): the "resume" line gives the seconds to open
#      and verify the checkpoint (every file's CRC-32C) and to restore the moments.
# Medians over the rounds; ratios are checkpoint GB/s over the disk's GB/s of the same run.
# The trainer's own start (allocating and initialising 1.9 GiB) is not timed.
#
# Usage: bench/ckpt.sh [BUILD_DIR] [DIR]  (defaults: build, $TMPDIR or /tmp): DIR holds the
#   checkpoints and dd's files (it must allow O_DIRECT: not a tmpfs).
#   FERRY=path/to/ferry times another binary (another commit's) with the same script.
# Prints a summary and appends it to bench/results/ckpt-DATE.txt.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bin=${FERRY:-${1:-$root/build}/ferry}
[ -d "${1:-$root/build}" ] || { echo "no build dir ${1:-$root/build}" >&2; exit 2; }
parent=${2:-${TMPDIR:-/tmp}}
rounds=${ROUNDS:-3}
mkdir -p "$parent"
tmp=$(mktemp -d "$parent/ferry-ckpt-bench.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
log="$root/bench/results/ckpt-$(date +%Y-%m-%d).txt"

median() { sort -n | awk '{a[NR]=$1} END {print (NR % 2 ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2)}'; }
# dd's own seconds ("... copied, 1.2 s, ...") for the bytes it moved
dd_s() { dd "$@" 2>&1 | sed -nE 's/.* copied, ([0-9.e+-]+) s,.*/\1/p'; }
evict() { for f in "$@"; do dd if="$f" iflag=nocache count=0 status=none; done; }
gbps() { awk -v b="$1" -v s="$2" 'BEGIN {printf "%.3f", b / s / 1e9}'; }
# seconds to read every file of "$@" with dd, given dd's extra flags first (then --)
read_s() {
    local flags=() t=0 f
    while [ "$1" != -- ]; do flags+=("$1"); shift; done
    shift
    for f in "$@"; do
        t=$(awk -v a="$t" -v b="$(dd_s if="$f" of=/dev/null bs=8M "${flags[@]}")" 'BEGIN {print a + b}')
    done
    echo "$t"
}

train=(train --model gpt2-124m --steps 1 --batch 1 --seq 64 --val-batches 1 --log-every 1
       --checkpoint-sync)
files=(model.safetensors optimizer.exp_avg.safetensors optimizer.exp_avg_sq.safetensors)
: >"$tmp/direct"; : >"$tmp/buffered"; : >"$tmp/ckpt"; : >"$tmp/read"; : >"$tmp/readbuf"
: >"$tmp/verify"
: >"$tmp/restore"
nbytes=""
for ((i = 0; i < rounds; i++)); do
    # the data files' size, known from the first round's checkpoint (the first round's dd
    # writes the size of gpt2-124m's: 3 x 497772912 bytes)
    mib=$(( ${nbytes:-1493318736} / 8388608 ))
    dd_s if=/dev/zero of="$tmp/dd" bs=8M count="$mib" oflag=direct conv=fsync >>"$tmp/direct"
    rm -f "$tmp/dd"
    dd_s if=/dev/zero of="$tmp/dd" bs=8M count="$mib" conv=fsync >>"$tmp/buffered"
    rm -f "$tmp/dd"
    ck="$tmp/ck"
    rm -rf "$ck"
    "$bin" "${train[@]}" --checkpoint-dir "$ck" >"$tmp/train.out" 2>&1 ||
        { cat "$tmp/train.out" >&2; exit 1; }
    line=$(grep '^ckpt' "$tmp/train.out" | tail -1)
    s=$(sed -nE 's/.* in ([0-9.]+) s[,)].*/\1/p' <<<"$line")
    [ -n "$s" ] || { echo "no ckpt line in: $(cat "$tmp/train.out")" >&2; exit 1; }
    step=$(readlink "$ck/latest")
    paths=("${files[@]/#/$ck/$step/}")
    nbytes=$(stat -c %s "${paths[@]}" | awk '{n += $1} END {print n}')
    echo "$s" >>"$tmp/ckpt"
    evict "${paths[@]}"
    read_s iflag=direct -- "${paths[@]}" >>"$tmp/read"
    evict "${paths[@]}"
    read_s -- "${paths[@]}" >>"$tmp/readbuf"
    evict "${paths[@]}"
    "$bin" "${train[@]}" --checkpoint-dir "$ck" --resume >"$tmp/resume.out" 2>&1 ||
        { cat "$tmp/resume.out" >&2; exit 1; }
    rl=$(grep '^resume' "$tmp/resume.out" | tail -1)
    v=$(sed -nE 's/.*verified in ([0-9.]+) s.*/\1/p' <<<"$rl")
    r=$(sed -nE 's/.*restored in ([0-9.]+) s.*/\1/p' <<<"$rl")
    echo "${v:-nan}" >>"$tmp/verify"
    echo "${r:-nan}" >>"$tmp/restore"
    echo "round $((i + 1)): dd direct $(tail -1 "$tmp/direct") s, dd buffered $(tail -1 "$tmp/buffered") s, checkpoint $s s, read direct $(tail -1 "$tmp/read") s, read buffered $t s, resume verify ${v:-?} s restore ${r:-?} s" >&2
done
dd_direct=$(median <"$tmp/direct"); dd_buf=$(median <"$tmp/buffered"); ck_s=$(median <"$tmp/ckpt")
rd=$(median <"$tmp/read"); rdb=$(median <"$tmp/readbuf"); ver=$(grep -v nan "$tmp/verify" | median || true)
res=$(grep -v nan "$tmp/restore" | median || true)
ddb=$(( ${nbytes} / 8388608 * 8388608 ))
{
    echo "== bench/ckpt.sh $(date -u +%Y-%m-%dT%H:%MZ) $("$bin" --version 2>/dev/null | head -1) on $(df --output=source,fstype "$parent" | tail -1 | tr -s ' ') ($rounds rounds, medians)"
    echo "disk write, O_DIRECT 8 MiB + fsync:    $(gbps "$ddb" "$dd_direct") GB/s ($ddb bytes in $dd_direct s)"
    echo "disk write, page cache 8 MiB + fsync:  $(gbps "$ddb" "$dd_buf") GB/s ($dd_buf s)"
    echo "checkpoint save (gpt2-124m, 3 files):  $(gbps "$nbytes" "$ck_s") GB/s ($nbytes bytes in $ck_s s)"
    echo "  ratio to O_DIRECT write:             $(awk -v a="$dd_direct" -v b="$ck_s" -v x="$nbytes" -v y="$ddb" 'BEGIN {printf "%.2f", (x / b) / (y / a)}')"
    echo "  ratio to page-cache write:           $(awk -v a="$dd_buf" -v b="$ck_s" -v x="$nbytes" -v y="$ddb" 'BEGIN {printf "%.2f", (x / b) / (y / a)}')"
    echo "disk read, O_DIRECT 8 MiB (the files): $(gbps "$nbytes" "$rd") GB/s ($rd s)"
    echo "disk read, page cache 8 MiB:           $(gbps "$nbytes" "$rdb") GB/s ($rdb s)"
    if [ -n "$ver" ]; then
        echo "resume: open + verify (CRC-32C):      $(gbps "$nbytes" "$ver") GB/s ($ver s), ratio to the O_DIRECT read $(awk -v a="$rd" -v b="$ver" 'BEGIN {printf "%.2f", a / b}'), to the page-cache read $(awk -v a="$rdb" -v b="$ver" 'BEGIN {printf "%.2f", a / b}')"
        echo "resume: moments restored (2 files):   $(gbps "$((nbytes * 2 / 3))" "$res") GB/s ($res s)"
    else
        echo "resume: this binary does not time its resume"
    fi
} | tee -a "$log"
