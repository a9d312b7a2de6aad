// The planning tests' second translation unit (test_planning.cpp says why they are grouped).
#include <doctest/doctest.h>

#include "test_traffic.cpp"
#include "test_cost_model.cpp"
#include "test_program.cpp"
#include "test_json.cpp"
#include "test_registry.cpp"
