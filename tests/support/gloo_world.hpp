#pragma once
// The comm::Gloo group of the test run, made once by tests/gloo_main.cpp: every rank
// meets at MASTER_ADDR:MASTER_PORT only once, and the test cases take copies of it or
// duplicate() it, so no case opens a second rendezvous on the same port.
#include "paratrain/comm/gloo/gloo.hpp"

paratrain::comm::Gloo& gloo_world();
