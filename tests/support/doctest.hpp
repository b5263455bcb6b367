#pragma once
// doctest for tests that also use LibTorch. Include this instead of <doctest/doctest.h>.
//
// Debian's LibTorch is built with glog, whose CHECK(condition) macros arrive with
// any c10 header. Included after doctest they replace doctest's CHECK, and a failed
// check then aborts the process instead of being reported. So: c10 first, glog's
// clashing macros removed, doctest last (c10's include guards keep them out after).
#include <c10/util/Logging.h>

#undef CHECK
#undef CHECK_EQ
#undef CHECK_NE
#undef CHECK_LT
#undef CHECK_LE
#undef CHECK_GT
#undef CHECK_GE

#include <doctest/doctest.h>
