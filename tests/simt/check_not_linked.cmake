# cmake -DBINARY=<file> -P check_not_linked.cmake
# Fails when the binary carries the SIMT emulator (its device name is in the emulator's runtime).
file(STRINGS ${BINARY} hits REGEX "simt-emulator")
if(hits)
  message(FATAL_ERROR "${BINARY} contains the SIMT emulator (test-only): ${hits}")
endif()
message(STATUS "${BINARY}: no SIMT emulator")
