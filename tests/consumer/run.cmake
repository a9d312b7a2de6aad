# ctest driver: install fasta2a from the build tree into a scratch prefix, then configure, build
# and run a consumer project against it (find_package), and again through add_subdirectory (the
# component consumers there configured only: below).
# Inputs: -DBUILD_DIR=<fasta2a build> -DSOURCE_DIR=<fasta2a source> -DWORK=<scratch dir>
#         -DCONSUMER=core|host|mpi (default core: tests/consumer; host, mpi: tests/consumer/<name>)
#         -DLAUNCH=<launcher, words separated by |> to run the program under (mpiexec -n 4 ...)
# For core it also checks find_package's component rules (tests/consumer/components), with and
# without MPI.
if(NOT CONSUMER)
  set(CONSUMER core)
endif()
if(CONSUMER STREQUAL "core")
  set(project_dir "${SOURCE_DIR}/tests/consumer")
  set(program consumer)
else()
  set(project_dir "${SOURCE_DIR}/tests/consumer/${CONSUMER}")
  set(program consumer_${CONSUMER})
endif()
string(REPLACE "|" ";" launch "${LAUNCH}")
list(REMOVE_ITEM launch "") # empty words (no MPIEXEC_PREFLAGS, say)

file(REMOVE_RECURSE "${WORK}")
file(MAKE_DIRECTORY "${WORK}")
function(step)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}\n${out}\n${err}")
  endif()
  message(STATUS "${out}")
endfunction()
step(${CMAKE_COMMAND} --install "${BUILD_DIR}" --prefix "${WORK}/prefix")
if(CONSUMER STREQUAL "core")
  step(${CMAKE_COMMAND} -S "${SOURCE_DIR}/tests/consumer/components" -B "${WORK}/components"
       "-DCMAKE_PREFIX_PATH=${WORK}/prefix")
  step(${CMAKE_COMMAND} -S "${SOURCE_DIR}/tests/consumer/components" -B "${WORK}/components-no-mpi"
       "-DCMAKE_PREFIX_PATH=${WORK}/prefix" -DNO_MPI=ON -DCMAKE_DISABLE_FIND_PACKAGE_MPI=TRUE)
endif()
foreach(mode IN ITEMS package subdirectory)
  if(mode STREQUAL "package")
    set(extra "-DCMAKE_PREFIX_PATH=${WORK}/prefix")
  else()
    set(extra "-DFASTA2A_SOURCE_DIR=${SOURCE_DIR}")
  endif()
  step(${CMAKE_COMMAND} -S "${project_dir}" -B "${WORK}/${mode}" ${extra})
  # The component consumers (host, mpi) through add_subdirectory: configured and generated, which
  # fails where fasta2a::host or fasta2a::mpi is not a target, but not built and run again: the same
  # source was built and run against the package, and the core consumer builds and runs both ways.
  # (Each build of a component consumer compiles the engine: about 10 s on 2 cores.)
  if(mode STREQUAL "subdirectory" AND NOT CONSUMER STREQUAL "core")
    break()
  endif()
  step(${CMAKE_COMMAND} --build "${WORK}/${mode}")
  step(${launch} "${WORK}/${mode}/${program}")
endforeach()
