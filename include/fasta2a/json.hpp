// fasta2a: plans as JSON documents ("fasta2a.plan.v1", docs/DESIGN.md section 5). Kept so that existing
// includes work: the writer (write_plan_json, plan_to_json and the general json_writer) is in
// json_writer.hpp, the reader (read_plan_json, load_plan_json) in plan_reader.hpp.
#pragma once

#include "fasta2a/json_writer.hpp"
#include "fasta2a/plan_reader.hpp"
