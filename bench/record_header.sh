# The one header of a measurement record (sourced by bench/*.sh): the
# machine, named well enough to tell the CPUs this project meets apart (the
# model name alone is often just "AMD EPYC"), the date, and the command.
#   source "$(dirname "$0")/record_header.sh"; record_header "$0 $*"
machine_line() {
  local name family model flags isa=()
  name=$(sed -n 's/^model name[[:space:]]*: *//p' /proc/cpuinfo | head -1)
  family=$(sed -n 's/^cpu family[[:space:]]*: *//p' /proc/cpuinfo | head -1)
  model=$(sed -n 's/^model[[:space:]]*: *//p' /proc/cpuinfo | head -1)
  flags=" $(sed -n 's/^flags[[:space:]]*: *//p' /proc/cpuinfo | head -1) "
  [[ $flags == *" fma "* ]] && isa+=(FMA)
  [[ $flags == *" avx512f "* ]] && isa+=(AVX-512)
  [[ $flags == *" avx512_bf16 "* ]] && isa+=(AVX512-BF16)
  [[ $flags == *" amx_bf16 "* ]] && isa+=(AMX-BF16)
  echo "${name:-unknown CPU} (family ${family:-?} model ${model:-?}; ${isa[*]:-no FMA}), $(nproc) cores, $(free -g | awk '/Mem:/{print $2}') GiB"
}
record_header() {
  echo "Machine: $(machine_line); $(date -u '+%F %H:%M') UTC. Command: \`$*\`."
}
