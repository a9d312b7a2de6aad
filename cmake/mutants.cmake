# Mutant test targets: a test executable built against a deliberately broken copy of a product
# header, to check that the test suite catches the bug (tools/MUTATION.md, "Mutant targets").
#
#   fasta2a_add_mutant(<target> HEADER <product header>
#                      REPLACE <exact text> WITH <text> [REPLACE <exact text> WITH <text>]...)
#
# At build time cmake/mutate_header.py copies HEADER to
# <build>/mutants/<target>/fasta2a/<file name>, replacing each REPLACE text (which must occur
# exactly once, else the build fails naming it) by its WITH text, and that folder goes FIRST on
# <target>'s include path, so that <fasta2a/<file name>> (and "fasta2a/<file name>") is the
# mutated copy in <target> alone. The product header holds no switch: no macro, no option of a
# release build reaches the mutation. Pass the texts as bracket arguments ([=[...]=]): they are
# taken literally, newlines and semicolons included. Needs Python 3 (the caller checks
# Python3_Interpreter_FOUND).
function(fasta2a_add_mutant target)
  set(header "")
  set(pairs "")
  set(texts "")
  set(dir ${CMAKE_CURRENT_BINARY_DIR}/mutants/${target})
  # ARGV<n> keeps each argument whole (semicolons included), which cmake_parse_arguments would not.
  set(i 1)
  set(n 0)
  while(i LESS ARGC)
    set(word "${ARGV${i}}")
    math(EXPR j "${i} + 1")
    if(NOT j LESS ARGC)
      message(FATAL_ERROR "fasta2a_add_mutant(${target}): ${word} needs a value")
    endif()
    if(word STREQUAL "HEADER")
      set(header "${ARGV${j}}")
    elseif(word STREQUAL "REPLACE")
      math(EXPR k "${i} + 2")
      math(EXPR l "${i} + 3")
      if(NOT l LESS ARGC OR NOT "${ARGV${k}}" STREQUAL "WITH")
        message(FATAL_ERROR "fasta2a_add_mutant(${target}): REPLACE <text> must be followed by WITH <text>")
      endif()
      foreach(part IN ITEMS old new)
        if(part STREQUAL "old")
          set(content "${ARGV${j}}")
        else()
          set(content "${ARGV${l}}")
        endif()
        set(file ${dir}/spec/${n}.${part})
        # Rewritten only when it changes, so that a reconfigure does not remake the mutant.
        file(WRITE ${file}.tmp "${content}")
        file(COPY_FILE ${file}.tmp ${file} ONLY_IF_DIFFERENT)
        list(APPEND pairs ${file})
      endforeach()
      math(EXPR n "${n} + 1")
      set(j ${l})
    else()
      message(FATAL_ERROR "fasta2a_add_mutant(${target}): unexpected argument '${word}' (HEADER, REPLACE, WITH)")
    endif()
    math(EXPR i "${j} + 1")
  endwhile()
  if(header STREQUAL "" OR n EQUAL 0)
    message(FATAL_ERROR "fasta2a_add_mutant(${target}): needs HEADER and at least one REPLACE ... WITH ...")
  endif()
  get_filename_component(header ${header} ABSOLUTE BASE_DIR ${CMAKE_CURRENT_SOURCE_DIR})
  if(NOT EXISTS ${header})
    message(FATAL_ERROR "fasta2a_add_mutant(${target}): no header ${header}")
  endif()
  get_filename_component(name ${header} NAME)
  set(out ${dir}/fasta2a/${name})
  set(script ${CMAKE_CURRENT_FUNCTION_LIST_DIR}/mutate_header.py)
  add_custom_command(OUTPUT ${out}
                     COMMAND ${Python3_EXECUTABLE} ${script} ${header} ${out} ${pairs}
                     DEPENDS ${header} ${script} ${pairs}
                     COMMENT "fasta2a: mutant copy of ${name} for ${target}"
                     VERBATIM)
  target_sources(${target} PRIVATE ${out})
  target_include_directories(${target} BEFORE PRIVATE ${dir})
endfunction()
