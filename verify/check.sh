#!/usr/bin/env bash
# Model-checks netreap's release protocol (verify/release.pml) with spin:
# the protocol must pass every property, and each bug variant must give a
# counterexample (else the properties would not be worth much). Exits
# non-zero on any surprise. Installs spin with apt when it is missing.
#
#   verify/check.sh          the checks CI runs (about a minute here)
#   verify/check.sh --full   also liveness on the largest configuration
#                            (about a minute more)
set -euo pipefail
cd "$(dirname "$0")"

full=false
case "${1:-}" in
  --full) full=true ;;
  "") ;;
  *) echo "usage: $0 [--full]" >&2; exit 2 ;;
esac

if ! command -v spin >/dev/null; then
  echo "spin is missing: installing the Debian package"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q spin >/dev/null \
    || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q spin >/dev/null; }
fi
command -v gcc >/dev/null || { echo "gcc is missing: spin's verifiers are C programs" >&2; exit 1; }
spin -V

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0
started=$(date +%s)

# check NAME EXPECT MODEL_DEFINES CC_FLAGS PAN_FLAGS [PATTERN PROPERTY]
#   EXPECT pass: no error, a complete search.
#   EXPECT fail: a counterexample whose text (pan's report and the replayed
#   trail) matches PATTERN; the trail is printed as a story.
check() {
  local name=$1 expect=$2 defines=$3 ccflags=$4 panflags=$5 pattern=${6:-} property=${7:-}
  local dir="$work/$name" t0 t1 out states result
  mkdir -p "$dir"
  cp release.pml "$dir/"
  t0=$(date +%s.%N)
  (
    cd "$dir"
    # shellcheck disable=SC2086
    spin -a $defines release.pml >spin.log 2>&1 || { cat spin.log; exit 1; }
    # shellcheck disable=SC2086
    gcc -w -DMEMLIM=4096 $ccflags -o pan pan.c
    # shellcheck disable=SC2086
    ./pan $panflags >pan.out 2>&1 || true
    if [ -e release.pml.trail ]; then
      # shellcheck disable=SC2086
      spin -t $defines release.pml >trail.out 2>&1 || true
    fi
  ) || { echo "FAIL $name: the model did not build"; failures=$((failures + 1)); return; }
  t1=$(date +%s.%N)
  out="$dir/pan.out"
  states=$(awk '/states, stored/ {print $1; exit}' "$out")
  # A pass counts only for a complete search; a counterexample ends the
  # search early by design.
  if grep -qE 'errors: [1-9]' "$out"; then
    result=fail
  elif grep -qE 'out of memory|max search depth too small|Search not completed' "$out"; then
    result="incomplete search"
  elif grep -qE 'errors: 0$' "$out"; then
    result=pass
  else
    result="no result"
  fi
  local verdict=ok
  if [ "$result" != "$expect" ]; then
    verdict=UNEXPECTED
  elif [ "$expect" = fail ] && [ -n "$pattern" ] \
       && ! grep -qsE "$pattern" "$out" "$dir/trail.out"; then
    # (No `cat | grep -q`: under pipefail, grep quitting early makes cat's
    # SIGPIPE fail the pipeline, a false "no match".)
    verdict=UNEXPECTED
    result="fail, but not the expected property ($pattern)"
  fi
  printf '%-4s %-34s expected %-4s got %-5s %12s states %6.1f s\n' \
    "$([ $verdict = ok ] && echo ok || echo FAIL)" "$name" "$expect" "$result" \
    "${states:-?}" "$(awk -v a="$t0" -v b="$t1" 'BEGIN { print b - a }')"
  if [ "$result" = fail ] || [ $verdict != ok ]; then
    [ -z "$property" ] || echo "       broken: $property"
    grep -E 'violated|acceptance cycle' "$out" | head -1 | sed 's/^/       pan: /' | cut -c1-160
    if [ -e "$dir/trail.out" ]; then
      grep -E 'MSC:|Error' "$dir/trail.out" | sed -e 's/^ *MSC: /       | /' -e 's/^spin: /       | spin: /' | cut -c1-160
    fi
  fi
  if [ $verdict != ok ]; then
    failures=$((failures + 1))
    [ "$result" = pass ] || sed 's/^/       /' "$out" | tail -20
  fi
}

# Big searches pay for -O2 (6 s of gcc here); small ones do not.
SAFETY="-O2 -DSAFETY -DCOLLAPSE"
LIVE="-O2 -DNFAIR=3 -DCOLLAPSE"
SAFETY_SMALL="-O0 -DSAFETY -DCOLLAPSE"
LIVE_SMALL="-O0 -DNFAIR=3 -DCOLLAPSE"

echo "== the protocol (2 IPs; container 0 restarted once with the same ID, container 1; one crash)"
check protocol.S1-S2 pass "" "$SAFETY" "-N no_dup -m200000 -w25"
check protocol.L.one-container pass "-DLIVES0=2 -DLIVES1=0" "$LIVE_SMALL" "-a -f -N released -m200000 -w20"
check protocol.L.two-containers pass "-DLIVES0=1 -DLIVES1=1" "$LIVE" "-a -f -N released -m200000 -w22"
if $full; then
  check protocol.L.full pass "" "$LIVE" "-a -f -N released -m200000 -w25"
fi

echo "== bug variants: each must give a counterexample"
check bug.dump-absence-is-death fail "-DBUG_DUMP_DEATH" "$SAFETY_SMALL" "-N no_dup -m200000 -w20" \
  'ns_alive\[res_g\[i\]\]' "S2b (released while its netns lives)"
check bug.no-last-look fail "-DBUG_NO_LAST_LOOK" "$SAFETY_SMALL" "-N no_dup -m200000 -w20" \
  'ns_ip\[0\]==i\)' "S2a (released while its IP is configured in a live netns)"
check bug.no-last-look.duplicate-ip fail "-DBUG_NO_LAST_LOOK -DNO_S2" "$SAFETY" "-N no_dup -m200000 -w25" \
  '_spin_nvr' "S1 (an IP in two live netns)"
check bug.group-look-before-lock fail "-DLOOK_BEFORE_LOCK" "$SAFETY_SMALL" "-N no_dup -m200000 -w20" \
  'ns_ip\[0\]==i\)' "S2a (a look shared by a group without the lock held)"
check bug.death-by-inode fail "-DBUG_INODE_DEATH" "$SAFETY_SMALL" "-N no_dup -m200000 -w20" \
  'ns_alive\[res_g\[i\]\]' "S2b (released while its netns lives)"
check bug.never-unlinks.liveness fail "-DBUG_NEVER_UNLINK -DLIVES0=1 -DLIVES1=1" "$LIVE_SMALL" \
  "-a -f -N released -m200000 -w20" 'acceptance cycle' "L (a dead netns's reservation kept forever)"

echo "== $(( $(date +%s) - started )) s in all"
if [ $failures -ne 0 ]; then
  echo "$failures check(s) did not come out as expected" >&2
  exit 1
fi
echo "all checks came out as expected"
