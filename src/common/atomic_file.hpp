#pragma once
// Output files written whole or not at all. Every file hpmoe writes (JSON
// results, placements, machine models, program dumps, traces, timelines,
// safetensors, checkpoint indexes) goes through AtomicFile.
#include <string>
#include <string_view>

namespace hpmoe {

// Bytes go to PATH.partial-PID beside the target; commit() checks the
// stream, fsyncs and renames it over PATH. Destroyed uncommitted (an error,
// an exception), it removes the temporary, so a failure leaves the previous
// file or none. While a temporary exists it is registered for removal on
// SIGINT, SIGTERM and SIGHUP (where those still have their default action),
// so a signal never leaves a truncated file or a stray temporary either;
// the same for SIGQUIT, SIGPIPE, SIGUSR1/2, SIGALRM, SIGXCPU, SIGVTALRM and
// SIGPROF, and SIGXFSZ is ignored so that a write past the file-size limit
// fails and is reported. A target that exists and is not a regular file (a
// device such as /dev/stdout or /dev/full, a pipe) is written straight
// through and checked; a FIFO without a reader is an error, not a wait.
class AtomicFile {
 public:
  // `what` names the output in errors ("JSON results", "the trace").
  AtomicFile(std::string path, std::string what);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  void write(std::string_view bytes);
  // Syncs and closes the temporary, which stays until commit() renames it
  // into place (or the destructor removes it): a set of files can be
  // written whole before any of them replaces its target.
  void finish();
  void commit();

 private:
  [[noreturn]] void fail(const std::string& why);
  std::string path_, what_, temporary_;
  int fd_ = -1;
  int slot_ = -1;  // in the signal-cleanup table
  bool committed_ = false;
};

// While one lives, a terminating signal (those AtomicFile cleans up after)
// waits: it is noted, and acted on (temporaries removed, the signal raised
// again) when the last one ends. Around the renames of a set of files and
// what goes with them, so that a signal at any point leaves the old set or
// the new one, never new files beside old ones. The section must be short.
class DeferTerminationSignals {
 public:
  DeferTerminationSignals();
  ~DeferTerminationSignals();
  DeferTerminationSignals(const DeferTerminationSignals&) = delete;
  DeferTerminationSignals& operator=(const DeferTerminationSignals&) = delete;
};

// The whole file at once.
void write_file_atomically(const std::string& path, std::string_view bytes, const std::string& what);

}  // namespace hpmoe
