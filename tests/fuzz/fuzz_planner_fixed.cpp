// fuzz_planner's second translation unit: its planners over fixed_topology<8> (fuzz_planner.cpp).
#define FASTA2A_FUZZ_PLANNER_FIXED 1
#include "fuzz_planner.cpp"
