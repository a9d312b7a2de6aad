// doctest's main, the first file of every test program of this folder (tests/CMakeLists.txt,
// fasta2a_add_test): with the unity build it heads the program's one translation unit.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>
