#include "crash_trace.h"

#include <execinfo.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstring>

namespace bagua_lite {
namespace {

constexpr int kSignals[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT};
struct sigaction previous[NSIG];
std::atomic<bool> installed{false};

// write(2) only: what runs in a signal handler must not allocate or lock
void say(const char* s) {
  const ssize_t written = write(STDERR_FILENO, s, std::strlen(s));
  (void)written;
}

const char* signal_name(int sig) {
  switch (sig) {
    case SIGSEGV: return "SIGSEGV";
    case SIGBUS: return "SIGBUS";
    case SIGILL: return "SIGILL";
    case SIGFPE: return "SIGFPE";
    default: return "SIGABRT";
  }
}

void on_crash(int sig, siginfo_t*, void*) {
  say("bagua_lite: native backtrace of the crashing thread (");  // first: should the unwinding fault too
  say(signal_name(sig));
  say("):\n");
  void* frames[64];
  const int n = backtrace(frames, 64);
  backtrace_symbols_fd(frames, n, STDERR_FILENO);
  // The handler before ours takes it from here: the signal is blocked while this one runs, so it is
  // delivered to that handler once this returns (a fault's instruction would fault again anyway).
  sigaction(sig, &previous[sig], nullptr);
  raise(sig);
}

}  // namespace

bool install_crash_trace() {
  if (installed.exchange(true)) return false;
  void* warm[1];
  backtrace(warm, 1);  // loads the unwinder now: its first call may allocate, which a signal handler must not
  struct sigaction action;
  std::memset(&action, 0, sizeof action);
  action.sa_sigaction = on_crash;
  action.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&action.sa_mask);
  for (const int sig : kSignals) sigaction(sig, &action, &previous[sig]);
  return true;
}

}  // namespace bagua_lite
