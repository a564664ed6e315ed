#include "common/atomic_file.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <mutex>

#include "hpmoe/error.hpp"

namespace hpmoe {

namespace {

// Temporaries to remove if a signal ends the process. A signal handler can
// only reach process-wide state, so this table is the one global here: fixed
// slots of fixed-size paths, claimed and released with atomics, read by the
// handler with nothing but unlink(2), which is async-signal-safe.
constexpr int kSlots = 64;
constexpr std::size_t kMaxPath = 4096;
enum SlotState : int { kFree = 0, kFilling = 1, kPublished = 2 };  // the handler reads published slots only
struct CleanupTable {
  std::array<std::atomic<int>, kSlots> state{};
  std::array<std::array<char, kMaxPath>, kSlots> paths{};
  // While a set of files is renamed into place (DeferTerminationSignals), a
  // signal is noted here and acted on once the set is whole.
  std::atomic<int> defer_depth{0};
  std::atomic<int> pending_signal{0};
};
CleanupTable& cleanup_table() {
  static CleanupTable table;
  return table;
}

extern "C" void remove_temporaries_and_reraise(int signal_number) {
  CleanupTable& t = cleanup_table();
  if (t.defer_depth.load() > 0) {
    t.pending_signal.store(signal_number);
    return;
  }
  for (int i = 0; i < kSlots; ++i)
    if (t.state[static_cast<std::size_t>(i)].load() == kPublished) ::unlink(t.paths[static_cast<std::size_t>(i)].data());
  std::signal(signal_number, SIG_DFL);
  std::raise(signal_number);
}

void install_handlers_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    // Every signal whose default action ends the process and that can be
    // caught; the host's own handlers (Python's) are left alone.
    for (const int s : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGPIPE, SIGUSR1, SIGUSR2, SIGALRM, SIGXCPU, SIGVTALRM, SIGPROF}) {
      struct sigaction current {};
      if (::sigaction(s, nullptr, &current) != 0 || current.sa_handler != SIG_DFL) continue;
      struct sigaction action {};
      action.sa_handler = remove_temporaries_and_reraise;
      sigemptyset(&action.sa_mask);
      ::sigaction(s, &action, nullptr);
    }
    // Past the file-size limit, a write fails with EFBIG (and the output
    // reports it, removing its temporary) instead of the process ending
    // with SIGXFSZ and no word.
    struct sigaction current {};
    if (::sigaction(SIGXFSZ, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) std::signal(SIGXFSZ, SIG_IGN);
  });
}

int claim_slot(const std::string& path) {
  if (path.size() >= kMaxPath) return -1;
  install_handlers_once();
  CleanupTable& t = cleanup_table();
  for (int i = 0; i < kSlots; ++i) {
    auto& state = t.state[static_cast<std::size_t>(i)];
    int expected = kFree;
    if (!state.compare_exchange_strong(expected, kFilling)) continue;
    std::memcpy(t.paths[static_cast<std::size_t>(i)].data(), path.c_str(), path.size() + 1);
    state.store(kPublished);  // whole now: the handler may read it
    return i;
  }
  return -1;  // more than 64 files in flight: still atomic, only not cleaned up on a signal
}

void release_slot(int slot) {
  if (slot >= 0) cleanup_table().state[static_cast<std::size_t>(slot)].store(kFree);
}

}  // namespace

AtomicFile::AtomicFile(std::string path, std::string what) : path_(std::move(path)), what_(std::move(what)) {
  struct stat st {};
  if (::stat(path_.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) {
    if (S_ISDIR(st.st_mode)) fail("it is a directory");
    // A device or pipe: straight through. Opened without blocking, so a
    // FIFO that nobody reads is an error rather than a wait without end.
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd_ < 0 && errno == ENXIO) fail("it is a FIFO (named pipe) with no reader");
    if (fd_ < 0) fail(std::strerror(errno));
    if (const int flags = ::fcntl(fd_, F_GETFL); flags < 0 || ::fcntl(fd_, F_SETFL, flags & ~O_NONBLOCK) != 0)
      fail(std::strerror(errno));
    return;
  }
  temporary_ = path_ + ".partial-" + std::to_string(::getpid());
  slot_ = claim_slot(temporary_);
  fd_ = ::open(temporary_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) {
    const int why = errno;
    release_slot(slot_);
    slot_ = -1;
    temporary_.clear();
    fail(std::strerror(why));
  }
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_ && !temporary_.empty()) ::unlink(temporary_.c_str());
  release_slot(slot_);
}

void AtomicFile::fail(const std::string& why) {
  throw Error("cannot write " + what_ + " to '" + path_ + "': " + why);
}

void AtomicFile::write(std::string_view bytes) {
  for (std::size_t done = 0; done < bytes.size();) {
    const ssize_t n = ::write(fd_, bytes.data() + done, bytes.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      fail(std::strerror(errno));
    }
    done += static_cast<std::size_t>(n);
  }
}

void AtomicFile::finish() {
  if (fd_ < 0) return;
  if (!temporary_.empty() && ::fsync(fd_) != 0) fail(std::strerror(errno));
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) fail(std::strerror(errno));
}

void AtomicFile::commit() {
  finish();
  if (!temporary_.empty() && ::rename(temporary_.c_str(), path_.c_str()) != 0) fail(std::strerror(errno));
  committed_ = true;
}

DeferTerminationSignals::DeferTerminationSignals() {
  install_handlers_once();
  cleanup_table().defer_depth.fetch_add(1);
}

DeferTerminationSignals::~DeferTerminationSignals() {
  CleanupTable& t = cleanup_table();
  if (t.defer_depth.fetch_sub(1) != 1) return;
  if (const int signal_number = t.pending_signal.exchange(0)) remove_temporaries_and_reraise(signal_number);
}

void write_file_atomically(const std::string& path, std::string_view bytes, const std::string& what) {
  AtomicFile file(path, what);
  file.write(bytes);
  file.commit();
}

}  // namespace hpmoe
