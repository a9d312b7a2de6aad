# Runs PROG; passes when it exits 0 (a device was there and the check passed) or exits 77 with a
# line matching MESSAGE (no device, said clearly); fails otherwise.
execute_process(COMMAND ${PROG} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 120)
message("${out}${err}")
if(rc EQUAL 0)
  return()
endif()
if(rc EQUAL 77 AND "${out}${err}" MATCHES "${MESSAGE}")
  message("exit 77 with the expected message: passes")
  return()
endif()
message(FATAL_ERROR "${PROG} exited ${rc}; wanted 0, or 77 with a line matching '${MESSAGE}'")
