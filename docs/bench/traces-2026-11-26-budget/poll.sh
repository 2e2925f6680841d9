#!/bin/bash
# poll memory.stat of bladed-bench-* cgroups every 50 ms
while true; do
  for d in /sys/fs/cgroup/memory/process_api/*/bladed-bench-*; do
    [ -d "$d" ] || continue
    echo "T $(date +%s.%N) $d usage=$(cat $d/memory.usage_in_bytes) fail=$(cat $d/memory.failcnt)"
    grep -E "^(total_cache|total_rss|total_shmem|total_mapped_file|total_dirty|total_writeback|total_inactive_file|total_active_file) " $d/memory.stat | tr '\n' ' '; echo
  done
  sleep 0.05
done
