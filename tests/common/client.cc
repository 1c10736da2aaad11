#include "client.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>

#include <gtest/gtest.h>

extern "C" {
#include <pb_decode.h>
}

namespace hdtest {

Call::Call(const std::string &socket) {
  EXPECT_EQ(hd_channel_connect(socket.c_str(), &fd), HD_OK);
  EXPECT_EQ(hd_channel_pair(ends), HD_OK);
}

namespace {

// *fd: a connection to socket that a child made (it connected our socket, then exited).
void ConnectFromChild(const std::string &socket, int *out) {
  struct sockaddr_un addr = {};
  addr.sun_family = AF_UNIX;
  ASSERT_LT(socket.size(), sizeof addr.sun_path);
  memcpy(addr.sun_path, socket.c_str(), socket.size() + 1);
  const int fd = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  ASSERT_GE(fd, 0);
  *out = fd;
  // The child only connects and exits (async-signal-safe calls: this process may have threads).
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    _exit(connect(fd, reinterpret_cast<const struct sockaddr *>(&addr), sizeof addr) == 0 ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_EQ(status, 0) << "the child could not connect to " << socket;
}

}  // namespace

Call::Call(const std::string &socket, AnotherClient) {
  ConnectFromChild(socket, &fd);
  EXPECT_EQ(hd_channel_pair(ends), HD_OK);
}

void Call::SentTheirEnd() {
  close(ends[1]);
  ends[1] = -1;
}

Call::~Call() {
  for (int f : {fd, ends[0], ends[1]}) {
    if (f >= 0) close(f);
  }
}

hd_status RequestLiveSnapshot(Call &call, const heapdump_client_ProcessSelector *selector,
                              bool with_contents, bool multi) {
  heapdump_client_CollectorTakeLiveSnapshotRequest req =
      heapdump_client_CollectorTakeLiveSnapshotRequest_init_zero;
  if (selector != nullptr) {
    req.has_process_selector = true;
    req.process_selector = *selector;
  }
  req.has_receiver = true;
  req.receiver = {true, 0};
  req.has_with_contents = req.has_multi_process = true;
  req.with_contents = with_contents;
  req.multi_process = multi;
  auto msg = std::make_unique<hd_message>();
  hd_status status =
      hd_fidl_collector_take_live_snapshot(call.fd, msg.get(), &req, &call.ends[1], 1);
  call.SentTheirEnd();
  return status;
}

std::unique_ptr<Result> TakeLiveSnapshot(const std::string &socket,
                                         const heapdump_client_ProcessSelector *selector,
                                         bool with_contents, bool multi) {
  auto result = std::make_unique<Result>();
  Call call(socket);
  EXPECT_EQ(RequestLiveSnapshot(call, selector, with_contents, multi), HD_OK);
  result->status = hd_snapshot_receive(call.ends[0], multi, &result->ra, &result->error);
  if (result->status == HD_OK && result->error == 0) {
    result->status = hd_reassembler_finish(&result->ra);
  }
  return result;
}

std::unique_ptr<Result> Download(const std::string &socket, uint32_t id) {
  auto result = std::make_unique<Result>();
  Call call(socket);
  auto msg = std::make_unique<hd_message>();
  heapdump_client_CollectorDownloadStoredSnapshotRequest req =
      heapdump_client_CollectorDownloadStoredSnapshotRequest_init_zero;
  req.has_snapshot_id = req.has_receiver = true;
  req.snapshot_id = id;
  req.receiver = {true, 0};
  EXPECT_EQ(hd_fidl_collector_download_stored_snapshot(call.fd, msg.get(), &req, &call.ends[1], 1),
            HD_OK);
  call.SentTheirEnd();
  result->status = hd_snapshot_receive(call.ends[0], false, &result->ra, &result->error);
  if (result->status == HD_OK && result->error == 0) {
    result->status = hd_reassembler_finish(&result->ra);
  }
  return result;
}

namespace {

bool DecodeStored(pb_istream_t *stream, const pb_field_t *, void **arg) {
  heapdump_client_StoredSnapshot s = heapdump_client_StoredSnapshot_init_zero;
  if (!pb_decode(stream, heapdump_client_StoredSnapshot_fields, &s)) return false;
  Stored out;
  out.id = s.snapshot_id;
  out.name = s.snapshot_name;
  out.process_name = s.process_name;
  out.pid = s.process_koid;
  out.has_totals = s.has_taken_at_unix_ns && s.has_live_bytes && s.has_live_blocks;
  out.taken_at_unix_ns = s.taken_at_unix_ns;
  out.live_bytes = s.live_bytes;
  out.live_blocks = s.live_blocks;
  out.stored_bytes = s.stored_bytes;
  static_cast<std::vector<Stored> *>(*arg)->push_back(out);
  return true;
}

bool PrepareResponse(pb_istream_t *, const pb_field_t *field, void **arg) {
  if (field->tag == heapdump_client_StoredSnapshotIteratorGetNextResult_response_tag) {
    auto *response =
        static_cast<heapdump_client_StoredSnapshotIteratorGetNextResponse *>(field->pData);
    response->batch.arg = *arg;
    response->batch.funcs.decode = DecodeStored;
  }
  return true;
}

}  // namespace

Listing List(const std::string &socket, const heapdump_client_ProcessSelector *selector) {
  Listing listing;
  Call call(socket);
  auto msg = std::make_unique<hd_message>();
  heapdump_client_CollectorListStoredSnapshotsRequest req =
      heapdump_client_CollectorListStoredSnapshotsRequest_init_zero;
  req.has_iterator = true;
  req.iterator = {true, 0};
  if (selector != nullptr) {
    req.has_process_selector = true;
    req.process_selector = *selector;
  }
  EXPECT_EQ(hd_fidl_collector_list_stored_snapshots(call.fd, msg.get(), &req, &call.ends[1], 1),
            HD_OK);
  call.SentTheirEnd();
  for (;;) {
    heapdump_client_StoredSnapshotIteratorGetNextRequest next =
        heapdump_client_StoredSnapshotIteratorGetNextRequest_init_zero;
    heapdump_client_StoredSnapshotIteratorGetNextResult result =
        heapdump_client_StoredSnapshotIteratorGetNextResult_init_zero;
    size_t before = listing.items.size();
    result.cb_result.arg = &listing.items;
    result.cb_result.funcs.decode = PrepareResponse;
    listing.status = hd_fidl_stored_snapshot_iterator_get_next(call.ends[0], msg.get(), &next,
                                                               nullptr, 0, &result);
    if (listing.status != HD_OK) break;
    if (result.which_result == heapdump_client_StoredSnapshotIteratorGetNextResult_err_tag) {
      listing.error = static_cast<uint32_t>(result.result.err);
      break;
    }
    if (listing.items.size() == before) break;
  }
  return listing;
}

CallResult Delete(const std::string &socket, uint32_t id) {
  CallResult out;
  Call call(socket);
  auto msg = std::make_unique<hd_message>();
  heapdump_client_CollectorDeleteStoredSnapshotRequest req =
      heapdump_client_CollectorDeleteStoredSnapshotRequest_init_zero;
  req.has_snapshot_id = true;
  req.snapshot_id = id;
  heapdump_client_CollectorDeleteStoredSnapshotResult result =
      heapdump_client_CollectorDeleteStoredSnapshotResult_init_zero;
  out.status =
      hd_fidl_collector_delete_stored_snapshot(call.fd, msg.get(), &req, nullptr, 0, &result);
  if (result.which_result == heapdump_client_CollectorDeleteStoredSnapshotResult_err_tag) {
    out.error = static_cast<uint32_t>(result.result.err);
  }
  return out;
}

ProcessStatus GetProcessState(const std::string &socket, pid_t pid) {
  ProcessStatus out;
  Call call(socket);
  auto msg = std::make_unique<hd_message>();
  heapdump_client_CollectorGetProcessStateRequest req =
      heapdump_client_CollectorGetProcessStateRequest_init_zero;
  req.has_process_koid = true;
  req.process_koid = static_cast<uint64_t>(pid);
  heapdump_client_CollectorGetProcessStateResult result =
      heapdump_client_CollectorGetProcessStateResult_init_zero;
  out.status = hd_fidl_collector_get_process_state(call.fd, msg.get(), &req, nullptr, 0, &result);
  if (result.which_result == heapdump_client_CollectorGetProcessStateResult_err_tag) {
    out.error = static_cast<uint32_t>(result.result.err);
  } else if (out.status == HD_OK) {
    out.state = result.result.response.state;
    out.exit_snapshot_id = result.result.response.exit_snapshot_id;
    out.process_name = result.result.response.process_name;
    out.has_arm_failure = result.result.response.has_arm_failure;
    out.arm_failure = result.result.response.arm_failure;
    out.arm_failure_generation = result.result.response.arm_failure_generation;
  }
  return out;
}

uint32_t StoredId(const Listing &listing, const std::string &name) {
  uint32_t id = 0;
  int found = 0;
  for (const Stored &s : listing.items) {
    if (s.name == name) {
      id = s.id;
      found++;
    }
  }
  return found == 1 ? id : 0;
}

heapdump_client_ProcessSelector ByPid(pid_t pid) {
  heapdump_client_ProcessSelector s = heapdump_client_ProcessSelector_init_zero;
  s.which_selector = heapdump_client_ProcessSelector_by_koid_tag;
  s.selector.by_koid = static_cast<uint64_t>(pid);
  return s;
}

heapdump_client_ProcessSelector ByName(const char *name) {
  heapdump_client_ProcessSelector s = heapdump_client_ProcessSelector_init_zero;
  s.which_selector = heapdump_client_ProcessSelector_by_name_tag;
  snprintf(s.selector.by_name, sizeof s.selector.by_name, "%s", name);
  return s;
}

heapdump_client_ProcessSelector UnknownSelector() {
  // Encoded as an empty ProcessSelector: present, with no variant set.
  heapdump_client_ProcessSelector s = heapdump_client_ProcessSelector_init_zero;
  return s;
}

}  // namespace hdtest
