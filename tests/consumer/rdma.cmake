# ctest driver of an RDMA transport's package consumer (tests/consumer/rdma): install fasta2a from
# the build tree into a scratch prefix, then configure, build and run the consumer of that
# transport's component against it. Exit status 77 of the program (libfabric: provider not usable)
# is passed on; the verbs consumer exits 0 with the reason where there is no device.
# Inputs: -DBUILD_DIR=<fasta2a build> -DSOURCE_DIR=<fasta2a source> -DWORK=<scratch dir>
#         -DTRANSPORT=libfabric|verbs
file(REMOVE_RECURSE "${WORK}")
file(MAKE_DIRECTORY "${WORK}")
function(step)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message(STATUS "${out}")
  if(rc EQUAL 77)
    message(STATUS "skipped")
    # cmake -P cannot choose its exit status: the test's SKIP_REGULAR_EXPRESSION reads this.
    message(FATAL_ERROR "FASTA2A_SKIPPED: ${out}")
  elseif(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}\n${out}\n${err}")
  endif()
endfunction()
step(${CMAKE_COMMAND} --install "${BUILD_DIR}" --prefix "${WORK}/prefix")
step(${CMAKE_COMMAND} -S "${SOURCE_DIR}/tests/consumer/rdma" -B "${WORK}/build" "-DCMAKE_PREFIX_PATH=${WORK}/prefix"
     "-DFASTA2A_TRANSPORT=${TRANSPORT}")
step(${CMAKE_COMMAND} --build "${WORK}/build")
step("${WORK}/build/consumer_${TRANSPORT}")
