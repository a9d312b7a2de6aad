# fasta2a_add_transport(<name> HEADERS <header>... [LINK <target>...] [NO_VERIFY] [NO_INSTALL]
#                       [CONSUMER_TEST <ctest name> CONSUMER_PASS <regex>])
#
# A transport's targets, as transports/<name>/CMakeLists.txt calls it: the INTERFACE library
# fasta2a_<name> with the alias fasta2a::<name> (installed as fasta2a::<name> too), linking
# fasta2a::fasta2a and LINK, its HEADERS (names under the folder's include/fasta2a/) as a header
# set, each compiled on its own with the tests (not with NO_VERIFY, nor in sanitizer builds).
# Unless NO_INSTALL, with FASTA2A_INSTALL: the package's "<name>" component, in its own export set
# fasta2a-<name>-targets, so that only find_package(fasta2a COMPONENTS <name>) looks for what LINK
# needs (cmake/fasta2a-config.cmake.in). With CONSUMER_TEST (the libfabric and verbs transports):
# the ctest test of that name, where tests and install rules are on, installs the build into a
# scratch prefix and builds and runs tests/consumer/rdma against that component
# (tests/consumer/rdma.cmake); it passes where its output matches CONSUMER_PASS, and is skipped
# where the program exits 77. The test is added at the end of the calling folder's CMakeLists.txt,
# after the folder's own tests.
function(fasta2a_add_transport name)
  cmake_parse_arguments(PARSE_ARGV 1 arg "NO_VERIFY;NO_INSTALL" "CONSUMER_TEST;CONSUMER_PASS" "HEADERS;LINK")
  if(arg_UNPARSED_ARGUMENTS OR NOT arg_HEADERS)
    message(FATAL_ERROR "fasta2a_add_transport(${name}): HEADERS needed; not understood: ${arg_UNPARSED_ARGUMENTS}")
  endif()
  set(lib fasta2a_${name})
  add_library(${lib} INTERFACE)
  add_library(fasta2a::${name} ALIAS ${lib})
  target_link_libraries(${lib} INTERFACE fasta2a::fasta2a ${arg_LINK})
  list(TRANSFORM arg_HEADERS PREPEND ${CMAKE_CURRENT_SOURCE_DIR}/include/fasta2a/)
  target_sources(${lib} INTERFACE FILE_SET HEADERS BASE_DIRS ${CMAKE_CURRENT_SOURCE_DIR}/include FILES ${arg_HEADERS})
  set_target_properties(${lib} PROPERTIES EXPORT_NAME ${name})
  if(NOT arg_NO_VERIFY AND FASTA2A_BUILD_TESTS AND NOT FASTA2A_SANITIZE)
    set_target_properties(${lib} PROPERTIES VERIFY_INTERFACE_HEADER_SETS ON)
  endif()
  if(FASTA2A_INSTALL AND NOT arg_NO_INSTALL)
    install(TARGETS ${lib} EXPORT fasta2a-${name}-targets FILE_SET HEADERS)
    install(EXPORT fasta2a-${name}-targets NAMESPACE fasta2a:: DESTINATION ${FASTA2A_INSTALL_CMAKEDIR})
  endif()
  if(arg_CONSUMER_TEST AND FASTA2A_BUILD_TESTS AND FASTA2A_INSTALL)
    # A deferred call reads its arguments' variables when it runs, after this function's are
    # gone: the values go into its code now.
    cmake_language(EVAL CODE "cmake_language(DEFER CALL _fasta2a_transport_consumer_test [[${name}]] [[${arg_CONSUMER_TEST}]] [[${arg_CONSUMER_PASS}]])")
  endif()
endfunction()

function(_fasta2a_transport_consumer_test name test pass)
  enable_testing()
  add_test(NAME ${test}
           COMMAND ${CMAKE_COMMAND} -DBUILD_DIR=${PROJECT_BINARY_DIR} -DSOURCE_DIR=${PROJECT_SOURCE_DIR}
                   -DWORK=${CMAKE_CURRENT_BINARY_DIR}/consumer-${name} -DTRANSPORT=${name}
                   -P ${PROJECT_SOURCE_DIR}/tests/consumer/rdma.cmake)
  set_tests_properties(${test} PROPERTIES TIMEOUT 600 LABELS ${name} SKIP_REGULAR_EXPRESSION "FASTA2A_SKIPPED"
                       PROCESSORS 2 PASS_REGULAR_EXPRESSION "${pass}")
endfunction()
