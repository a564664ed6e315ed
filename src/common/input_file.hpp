#pragma once
// Opening an input: only a regular file is read. A FIFO (or a socket, a
// terminal, a device) given where hpmoe expects a config, placement, trace,
// machine model, program dump, checkpoint index or shard would block open()
// until a writer appears, or be read partly; a directory reads as nothing.
// Each is refused with one line naming the input before anything opens it.
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <string>

#include "hpmoe/error.hpp"

namespace hpmoe {

// Throws unless `path` names a regular file (after symbolic links).
// `what` names the input ("config file 'x.json'").
inline void require_regular_file(const std::string& path, const std::string& what) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0)
    throw Error("cannot open " + what + ": " + std::strerror(errno));
  if (S_ISREG(st.st_mode)) return;
  const char* kind = S_ISDIR(st.st_mode)    ? "a directory"
                     : S_ISFIFO(st.st_mode) ? "a FIFO (named pipe)"
                     : S_ISSOCK(st.st_mode) ? "a socket"
                     : S_ISCHR(st.st_mode)  ? "a character device"
                     : S_ISBLK(st.st_mode)  ? "a block device"
                                            : "not a regular file";
  throw Error(what + " is " + kind + ", not a regular file: hpmoe reads its inputs from files (write the data to a file first)");
}

// The file `path` opened for reading, once require_regular_file accepted it.
inline std::ifstream open_input(const std::string& path, const std::string& what,
                                std::ios::openmode mode = std::ios::in) {
  require_regular_file(path, what);
  std::ifstream in(path, mode);
  if (!in) throw Error("cannot open " + what + ": " + std::strerror(errno));
  return in;
}

}  // namespace hpmoe
