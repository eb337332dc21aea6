// Argument checks whose failure reaches Python as a RuntimeError naming the field, on any torch.
//
// TORCH_CHECK with values formats a std::string in this library and hands it to libc10. On the GPU
// image's torch 2.11 that hand-over segfaulted (every check with values; those with a literal message
// raised as they should), so a bad argument killed the process instead of reaching the caller. Here
// the message is formatted with snprintf and crosses into libc10 as a const char*, the path the
// literal messages take.
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
