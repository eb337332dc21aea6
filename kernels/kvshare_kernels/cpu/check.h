// Argument checks whose failure reaches Python as a RuntimeError naming the field.
//
// On the GPU image's torch 2.11 every TORCH_CHECK whose message carried values segfaulted instead of
// raising; those with a literal message raised. What differs between the two is that values make
// TORCH_CHECK format a std::string in this library and hand it to libc10. Here the message is
// formatted with snprintf and crosses into libc10 as a const char*, the path the literal messages
// take. torch 2.11 from PyPI with g++ 12 on a CPU machine raised with either kind of check, so the
// cause lies in that image's toolchain; whether this avoids it is for its next kernel-test run to show.
#pragma once

#include <c10/util/Exception.h>

#include <cstdio>

template <typename... Args>
[[noreturn]] inline void kv_check_failed(const char* format, Args... args) {
  char message[512];
  std::snprintf(message, sizeof message, format, args...);
  TORCH_CHECK(false, static_cast<const char*>(message));
}

// KV_CHECK(condition, printf format, values...); int64_t values go in as long long (%lld).
#define KV_CHECK(condition, ...)                   \
  do {                                             \
    if (!(condition)) kv_check_failed(__VA_ARGS__); \
  } while (0)
