#pragma once
/// \file
/// The message of an exception, as paratrain reports it again: LibTorch's without its
/// backtrace, a paratrain::error's without its "paratrain: " when wrapped into another.

#include <c10/util/Exception.h>

#include <exception>
#include <string>

namespace paratrain::detail {

/// An exception's message; LibTorch's without the C++ backtrace it carries.
inline std::string message_of(const std::exception& e) {
  if (const auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  return e.what();
}

/// message_of without the "paratrain: " that paratrain::error's messages begin with: for
/// a message wrapped into another paratrain::error.
inline std::string inner_message(const std::exception& e) {
  auto m = message_of(e);
  return m.rfind("paratrain: ", 0) == 0 ? m.substr(11) : m;
}

}  // namespace paratrain::detail
