// Tests of the fidl/ layer over real sockets: framing, handles, bindings, batching, reassembly and
// every malformed-input path.
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

extern "C" {
#include <pb_encode.h>

#include "heapdump/fidl/batch.h"
#include "heapdump/fidl/channel.h"
#include "heapdump/fidl/message.h"
#include "heapdump/fidl/snapshot.h"
#include "heapdump_client.bindings.h"
#include "heapdump_process.bindings.h"
}

namespace {

int CountOpenFds() {
  int count = 0;
  DIR *dir = opendir("/proc/self/fd");
  while (dirent *entry = readdir(dir)) {
    if (entry->d_name[0] != '.') count++;
  }
  closedir(dir);
  return count;
}

struct Pair {
  int a = -1, b = -1;
  Pair() {
    int ends[2];
    EXPECT_EQ(hd_channel_pair(ends), HD_OK);
    a = ends[0];
    b = ends[1];
  }
  ~Pair() {
    if (a >= 0) close(a);
    if (b >= 0) close(b);
  }
};

std::unique_ptr<hd_message> NewMessage() {
  auto msg = std::make_unique<hd_message>();
  hd_message_init(msg.get());
  return msg;
}

// Writes a raw datagram (header + body) on a channel, bypassing the encoder.
void SendRaw(int fd, const std::vector<uint8_t> &bytes, const std::vector<int> &fds = {}) {
  ASSERT_EQ(hd_channel_send(fd, bytes.data(), bytes.size(), fds.data(), fds.size()), HD_OK);
}

std::vector<uint8_t> Header(uint32_t txid, uint64_t ordinal, uint8_t flags = 0,
                            uint8_t magic = HD_WIRE_MAGIC) {
  std::vector<uint8_t> h(16, 0);
  for (int i = 0; i < 4; i++) h[i] = static_cast<uint8_t>(txid >> (8 * i));
  h[4] = flags;
  h[7] = magic;
  for (int i = 0; i < 8; i++) h[8 + i] = static_cast<uint8_t>(ordinal >> (8 * i));
  return h;
}

int MakeMemfd(const std::string &contents) {
  int fd = memfd_create("hd-test", MFD_CLOEXEC);
  EXPECT_GE(fd, 0);
  EXPECT_EQ(write(fd, contents.data(), contents.size()), static_cast<ssize_t>(contents.size()));
  return fd;
}

std::string ReadAll(int fd) {
  std::string out;
  char buf[256];
  lseek(fd, 0, SEEK_SET);
  ssize_t n;
  while ((n = read(fd, buf, sizeof buf)) > 0) out.append(buf, n);
  return out;
}

// ---- a receiver that records what a Collector server was asked -------------------------------

struct CollectorCalls {
  int take_live_snapshot = 0;
  bool with_contents = false;
  std::string by_name;
  int receiver_fd = -1;
};

hd_status OnTakeLiveSnapshot(void *ctx, hd_message *msg,
                             heapdump_client_CollectorTakeLiveSnapshotRequest *req) {
  auto *calls = static_cast<CollectorCalls *>(ctx);
  calls->take_live_snapshot++;
  calls->with_contents = req->has_with_contents && req->with_contents;
  if (req->has_process_selector &&
      req->process_selector.which_selector == heapdump_client_ProcessSelector_by_name_tag) {
    calls->by_name = req->process_selector.selector.by_name;
  }
  calls->receiver_fd = hd_message_take_fd(msg, &req->receiver);
  return HD_OK;
}

const hd_fidl_collector_server kCollector = {
    .take_live_snapshot_prepare = nullptr,
    .take_live_snapshot = OnTakeLiveSnapshot,
    .list_stored_snapshots_prepare = nullptr,
    .list_stored_snapshots = nullptr,
    .download_stored_snapshot_prepare = nullptr,
    .download_stored_snapshot = nullptr,
    .delete_stored_snapshot_prepare = nullptr,
    .delete_stored_snapshot = nullptr,
    .get_process_state_prepare = nullptr,
    .get_process_state = nullptr,
    .arm_process_prepare = nullptr,
    .arm_process = nullptr,
};

TEST(Channel, OneWayCallCarriesTheReceiverEnd) {
  Pair pair;
  Pair receiver;
  auto msg = NewMessage();
  heapdump_client_CollectorTakeLiveSnapshotRequest req =
      heapdump_client_CollectorTakeLiveSnapshotRequest_init_zero;
  req.has_process_selector = true;
  req.process_selector.which_selector = heapdump_client_ProcessSelector_by_name_tag;
  strcpy(req.process_selector.selector.by_name, "demo");
  req.has_receiver = true;
  req.receiver.has_index = true;
  req.receiver.index = 0;
  req.has_with_contents = true;
  req.with_contents = true;
  int fds[] = {receiver.b};
  ASSERT_EQ(hd_fidl_collector_take_live_snapshot(pair.a, msg.get(), &req, fds, 1), HD_OK);

  auto in = NewMessage();
  ASSERT_EQ(hd_message_recv(pair.b, in.get()), HD_OK);
  EXPECT_EQ(in->txid, 0u);
  EXPECT_EQ(in->ordinal, HD_ORDINAL_COLLECTOR_TAKE_LIVE_SNAPSHOT);
  CollectorCalls calls;
  ASSERT_EQ(hd_fidl_collector_dispatch(&kCollector, &calls, in.get()), HD_OK);
  EXPECT_EQ(calls.take_live_snapshot, 1);
  EXPECT_TRUE(calls.with_contents);
  EXPECT_EQ(calls.by_name, "demo");
  ASSERT_GE(calls.receiver_fd, 0);
  // The received end really is the peer of receiver.a.
  const char ping[] = "ping";
  ASSERT_EQ(hd_channel_send(receiver.a, ping, sizeof ping, nullptr, 0), HD_OK);
  char got[8] = {};
  size_t size = 0, nfds = 0;
  int none[1];
  ASSERT_EQ(hd_channel_recv(calls.receiver_fd, got, sizeof got, &size, none, 1, &nfds), HD_OK);
  EXPECT_STREQ(got, "ping");
  close(calls.receiver_fd);
}

TEST(Channel, MemfdTravelsWithItsContents) {
  Pair pair;
  int memfd = MakeMemfd("table bytes");
  auto msg = NewMessage();
  heapdump_process_SnapshotSinkStoreNamedSnapshotRequest req =
      heapdump_process_SnapshotSinkStoreNamedSnapshotRequest_init_zero;
  req.has_name = true;
  strcpy(req.name, "after-load");
  req.has_allocations_snapshot = true;
  req.allocations_snapshot.has_index = true;
  req.allocations_snapshot.index = 0;

  // A server thread answers the two-way call with an id.
  std::thread server([&] {
    auto in = NewMessage();
    ASSERT_EQ(hd_message_recv(pair.b, in.get()), HD_OK);
    struct Ctx {
      std::string name, contents;
      int b;
    } ctx{"", "", pair.b};
    hd_fidl_snapshot_sink_server sink = {};
    sink.store_named_snapshot = [](void *c, hd_message *m,
                                   heapdump_process_SnapshotSinkStoreNamedSnapshotRequest *r) {
      auto *ctx = static_cast<Ctx *>(c);
      ctx->name = r->name;
      int fd = hd_message_take_fd(m, &r->allocations_snapshot);
      ctx->contents = ReadAll(fd);
      close(fd);
      heapdump_process_SnapshotSinkStoreNamedSnapshotResponse resp =
          heapdump_process_SnapshotSinkStoreNamedSnapshotResponse_init_zero;
      resp.has_snapshot_id = true;
      resp.snapshot_id = 42;
      uint32_t txid = m->txid;
      return hd_fidl_snapshot_sink_store_named_snapshot_reply(ctx->b, m, txid, &resp);
    };
    ASSERT_EQ(hd_fidl_snapshot_sink_dispatch(&sink, &ctx, in.get()), HD_OK);
    EXPECT_EQ(ctx.name, "after-load");
    EXPECT_EQ(ctx.contents, "table bytes");
  });
  heapdump_process_SnapshotSinkStoreNamedSnapshotResponse resp =
      heapdump_process_SnapshotSinkStoreNamedSnapshotResponse_init_zero;
  int fds[] = {memfd};
  ASSERT_EQ(hd_fidl_snapshot_sink_store_named_snapshot(pair.a, msg.get(), &req, fds, 1, &resp),
            HD_OK);
  server.join();
  EXPECT_TRUE(resp.has_snapshot_id);
  EXPECT_EQ(resp.snapshot_id, 42u);
  EXPECT_FALSE(resp.has_error);
  close(memfd);
}

TEST(Channel, EncoderRefusesHandlesThatDoNotMatchTheFds) {
  auto msg = NewMessage();
  heapdump_client_CollectorDownloadStoredSnapshotRequest req =
      heapdump_client_CollectorDownloadStoredSnapshotRequest_init_zero;
  req.has_snapshot_id = true;
  req.snapshot_id = 7;
  // Handle field absent.
  EXPECT_EQ(hd_message_encode(msg.get(), 0, 0, HD_ORDINAL_COLLECTOR_DOWNLOAD_STORED_SNAPSHOT,
                              &heapdump_client_CollectorDownloadStoredSnapshotRequest_msg, &req, 0),
            HD_ERR_INVALID_ARGS);
  req.has_receiver = true;
  req.receiver.has_index = true;
  req.receiver.index = 1;  // out of range for one fd
  EXPECT_EQ(hd_message_encode(msg.get(), 0, 0, HD_ORDINAL_COLLECTOR_DOWNLOAD_STORED_SNAPSHOT,
                              &heapdump_client_CollectorDownloadStoredSnapshotRequest_msg, &req, 1),
            HD_ERR_INVALID_ARGS);
  req.receiver.index = 0;
  EXPECT_EQ(hd_message_encode(msg.get(), 0, 0, HD_ORDINAL_COLLECTOR_DOWNLOAD_STORED_SNAPSHOT,
                              &heapdump_client_CollectorDownloadStoredSnapshotRequest_msg, &req, 2),
            HD_ERR_INVALID_ARGS);  // an fd no handle refers to
  EXPECT_EQ(hd_message_encode(msg.get(), 0, 0, HD_ORDINAL_COLLECTOR_DOWNLOAD_STORED_SNAPSHOT,
                              &heapdump_client_CollectorDownloadStoredSnapshotRequest_msg, &req, 1),
            HD_OK);
}

// ---- malformed input: each case gives its defined error and leaks no descriptor ---------------

class Malformed : public ::testing::Test {
 protected:
  Pair pair;
  std::unique_ptr<hd_message> in = NewMessage();
  int fds_before = 0;
  void SetUp() override { fds_before = CountOpenFds(); }
  hd_status DispatchNext() {
    hd_status status = hd_message_recv(pair.b, in.get());
    if (status != HD_OK) return status;
    CollectorCalls calls;
    status = hd_fidl_collector_dispatch(&kCollector, &calls, in.get());
    if (calls.receiver_fd >= 0) close(calls.receiver_fd);
    return status;
  }
  void ExpectNoLeak() { EXPECT_EQ(CountOpenFds(), fds_before); }
};

TEST_F(Malformed, TruncatedHeader) {
  std::vector<uint8_t> bytes = Header(0, HD_ORDINAL_COLLECTOR_TAKE_LIVE_SNAPSHOT);
  bytes.resize(15);
  int extra = MakeMemfd("x");
  SendRaw(pair.a, bytes, {extra});
  close(extra);
  EXPECT_EQ(DispatchNext(), HD_ERR_TRUNCATED_HEADER);
  ExpectNoLeak();
}

TEST_F(Malformed, BadMagicAndReservedFlags) {
  SendRaw(pair.a, Header(0, HD_ORDINAL_COLLECTOR_TAKE_LIVE_SNAPSHOT, 0, 0x7f));
  EXPECT_EQ(DispatchNext(), HD_ERR_BAD_MAGIC);
  SendRaw(pair.a, Header(0, HD_ORDINAL_COLLECTOR_TAKE_LIVE_SNAPSHOT, 0x80));
  EXPECT_EQ(DispatchNext(), HD_ERR_DECODE);
  ExpectNoLeak();
}

TEST_F(Malformed, UnknownOrdinal) {
  SendRaw(pair.a, Header(0, 0xdead));
  EXPECT_EQ(DispatchNext(), HD_ERR_UNKNOWN_ORDINAL);
  // Known to another protocol is still unknown to this one.
  SendRaw(pair.a, Header(1, HD_ORDINAL_REGISTRY_REGISTER));
  EXPECT_EQ(DispatchNext(), HD_ERR_UNKNOWN_ORDINAL);
  hd_message_close_fds(in.get());
  ExpectNoLeak();
}

TEST_F(Malformed, OversizedMessage) {
  std::vector<uint8_t> bytes = Header(0, HD_ORDINAL_COLLECTOR_TAKE_LIVE_SNAPSHOT);
  bytes.resize(HD_MAX_MESSAGE_BYTES + 100, 0);
  int extra = MakeMemfd("x");
  // hd_channel_send refuses to send it, so write it with the raw socket call.
  iovec iov = {bytes.data(), bytes.size()};
  char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr mh = {};
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  mh.msg_control = control;
  mh.msg_controllen = sizeof control;
  cmsghdr *cmsg = CMSG_FIRSTHDR(&mh);
  cmsg->cmsg_level = SOL_SOCKET;
  cmsg->cmsg_type = SCM_RIGHTS;
  cmsg->cmsg_len = CMSG_LEN(sizeof(int));
  memcpy(CMSG_DATA(cmsg), &extra, sizeof extra);
  ASSERT_EQ(sendmsg(pair.a, &mh, 0), static_cast<ssize_t>(bytes.size()));
  close(extra);
  EXPECT_EQ(DispatchNext(), HD_ERR_TOO_LARGE);
  EXPECT_EQ(hd_channel_send(pair.a, bytes.data(), bytes.size(), nullptr, 0), HD_ERR_INVALID_ARGS);
  ExpectNoLeak();
}

TEST_F(Malformed, TooManyFds) {
  std::vector<int> many;
  for (unsigned i = 0; i < HD_MAX_MESSAGE_FDS + 3; i++) many.push_back(MakeMemfd("x"));
  std::vector<uint8_t> bytes = Header(0, HD_ORDINAL_COLLECTOR_TAKE_LIVE_SNAPSHOT);
  iovec iov = {bytes.data(), bytes.size()};
  std::vector<char> control(CMSG_SPACE(sizeof(int) * many.size()));
  msghdr mh = {};
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  mh.msg_control = control.data();
  mh.msg_controllen = control.size();
  cmsghdr *cmsg = CMSG_FIRSTHDR(&mh);
  cmsg->cmsg_level = SOL_SOCKET;
  cmsg->cmsg_type = SCM_RIGHTS;
  cmsg->cmsg_len = CMSG_LEN(sizeof(int) * many.size());
  memcpy(CMSG_DATA(cmsg), many.data(), sizeof(int) * many.size());
  ASSERT_EQ(sendmsg(pair.a, &mh, 0), static_cast<ssize_t>(bytes.size()));
  for (int fd : many) close(fd);
  EXPECT_EQ(DispatchNext(), HD_ERR_TOO_MANY_FDS);
  ExpectNoLeak();
}

TEST_F(Malformed, MalformedVarint) {
  std::vector<uint8_t> bytes = Header(0, HD_ORDINAL_COLLECTOR_TAKE_LIVE_SNAPSHOT);
  // with_contents (field 3, varint) with eleven continuation bytes.
  bytes.push_back(0x18);
  for (int i = 0; i < 11; i++) bytes.push_back(0xff);
  SendRaw(pair.a, bytes);
  EXPECT_EQ(DispatchNext(), HD_ERR_DECODE);
  // A varint cut off by the end of the message.
  bytes = Header(0, HD_ORDINAL_COLLECTOR_TAKE_LIVE_SNAPSHOT);
  bytes.push_back(0x18);
  bytes.push_back(0x80);
  SendRaw(pair.a, bytes);
  EXPECT_EQ(DispatchNext(), HD_ERR_DECODE);
  ExpectNoLeak();
}

TEST_F(Malformed, WrongFieldType) {
  std::vector<uint8_t> bytes = Header(0, HD_ORDINAL_COLLECTOR_TAKE_LIVE_SNAPSHOT);
  // receiver (field 2) sent as a varint instead of a submessage.
  bytes.push_back(0x10);
  bytes.push_back(0x00);
  int extra = MakeMemfd("x");
  SendRaw(pair.a, bytes, {extra});
  close(extra);
  EXPECT_EQ(DispatchNext(), HD_ERR_DECODE);
  // A string longer than its bound.
  bytes = Header(0, HD_ORDINAL_COLLECTOR_TAKE_LIVE_SNAPSHOT);
  std::vector<uint8_t> selector = {0x0a, 40};
  selector.resize(42, 'a');
  bytes.push_back(0x0a);
  bytes.push_back(static_cast<uint8_t>(selector.size()));
  bytes.insert(bytes.end(), selector.begin(), selector.end());
  SendRaw(pair.a, bytes);
  EXPECT_EQ(DispatchNext(), HD_ERR_DECODE);
  ExpectNoLeak();
}

TEST_F(Malformed, MissingRequiredFd) {
  // A receiver handle refers to descriptor 0, but no descriptor came.
  std::vector<uint8_t> bytes = Header(0, HD_ORDINAL_COLLECTOR_TAKE_LIVE_SNAPSHOT);
  bytes.insert(bytes.end(), {0x12, 0x02, 0x08, 0x00});
  SendRaw(pair.a, bytes);
  EXPECT_EQ(DispatchNext(), HD_ERR_MISSING_FD);
  // No receiver handle at all.
  SendRaw(pair.a, Header(0, HD_ORDINAL_COLLECTOR_TAKE_LIVE_SNAPSHOT));
  EXPECT_EQ(DispatchNext(), HD_ERR_MISSING_FD);
  ExpectNoLeak();
}

TEST_F(Malformed, ExtraFdsAreClosed) {
  std::vector<uint8_t> bytes = Header(0, HD_ORDINAL_COLLECTOR_TAKE_LIVE_SNAPSHOT);
  bytes.insert(bytes.end(), {0x12, 0x02, 0x08, 0x00});
  int a = MakeMemfd("a"), b = MakeMemfd("b"), c = MakeMemfd("c");
  SendRaw(pair.a, bytes, {a, b, c});
  close(a);
  close(b);
  close(c);
  EXPECT_EQ(DispatchNext(), HD_ERR_UNEXPECTED_FD);
  ExpectNoLeak();
}

TEST_F(Malformed, OneWayWithTxidAndResponseFlag) {
  std::vector<uint8_t> bytes = Header(9, HD_ORDINAL_COLLECTOR_TAKE_LIVE_SNAPSHOT);
  bytes.insert(bytes.end(), {0x12, 0x02, 0x08, 0x00});
  int a = MakeMemfd("a");
  SendRaw(pair.a, bytes, {a});
  EXPECT_EQ(DispatchNext(), HD_ERR_UNEXPECTED_MESSAGE);
  bytes[0] = 0;
  bytes[4] = HD_FLAG_RESPONSE;
  SendRaw(pair.a, bytes, {a});
  close(a);
  EXPECT_EQ(DispatchNext(), HD_ERR_UNEXPECTED_MESSAGE);
  ExpectNoLeak();
}

TEST_F(Malformed, PeerClosed) {
  close(pair.a);
  pair.a = -1;
  EXPECT_EQ(DispatchNext(), HD_ERR_PEER_CLOSED);
}

TEST_F(Malformed, ReplyWithWrongTxidIsRefused) {
  std::thread server([&] {
    auto msg = NewMessage();
    ASSERT_EQ(hd_message_recv(pair.b, msg.get()), HD_OK);
    heapdump_client_Empty empty = heapdump_client_Empty_init_zero;
    ASSERT_EQ(
        hd_fidl_snapshot_receiver_report_error_reply(pair.b, msg.get(), msg->txid + 1, &empty),
        HD_OK);
  });
  auto msg = NewMessage();
  heapdump_client_SnapshotReceiverReportErrorRequest req =
      heapdump_client_SnapshotReceiverReportErrorRequest_init_zero;
  req.has_error = true;
  req.error = heapdump_client_CollectorError_LIVE_SNAPSHOT_FAILED;
  heapdump_client_Empty resp = heapdump_client_Empty_init_zero;
  EXPECT_EQ(hd_fidl_snapshot_receiver_report_error(pair.a, msg.get(), &req, nullptr, 0, &resp),
            HD_ERR_UNEXPECTED_MESSAGE);
  server.join();
}

// ---- batches ---------------------------------------------------------------------------------

// Collects the batch bodies a writer sends, each wrapped as a real message, and decodes them.
struct Capture {
  std::vector<std::vector<uint8_t>> bodies;
  static hd_status Send(void *ctx, const uint8_t *body, size_t size) {
    static_cast<Capture *>(ctx)->bodies.emplace_back(body, body + size);
    return HD_OK;
  }
};

std::unique_ptr<hd_batch_writer> NewWriter(Capture *capture) {
  auto w = std::make_unique<hd_batch_writer>();
  hd_batch_writer_init(w.get(), Capture::Send, capture);
  return w;
}

// Sends every captured body over a real channel through the generated Batch call and decodes it
// on the other side into a reassembler. Returns the largest message seen.
size_t Deliver(const Capture &capture, hd_reassembler *out, hd_status *final_status = nullptr) {
  Pair pair;
  size_t largest = 0;
  hd_status result = HD_OK;
  std::thread receiver([&] {
    auto in = NewMessage();
    auto reader = std::make_unique<hd_batch_reader>();
    hd_batch_reader_init(reader.get(), hd_reassembler_add, out);
    for (size_t i = 0; i < capture.bodies.size(); i++) {
      ASSERT_EQ(hd_message_recv(pair.b, in.get()), HD_OK);
      largest = std::max(largest, in->size);
      ASSERT_EQ(in->ordinal, HD_ORDINAL_SNAPSHOT_RECEIVER_BATCH);
      uint32_t txid = in->txid;
      hd_status status = hd_batch_reader_decode(reader.get(), in.get());
      if (status != HD_OK) result = status;
      heapdump_client_Empty ack = heapdump_client_Empty_init_zero;
      ASSERT_EQ(hd_fidl_snapshot_receiver_batch_reply(pair.b, in.get(), txid, &ack), HD_OK);
    }
  });
  auto scratch = NewMessage();
  hd_batch_channel ch;
  hd_batch_channel_init(&ch, pair.a, scratch.get());
  for (const auto &body : capture.bodies) {
    EXPECT_EQ(hd_batch_send_on_channel(&ch, body.data(), body.size()), HD_OK);
  }
  receiver.join();
  if (final_status) *final_status = result;
  return largest;
}

heapdump_client_SnapshotElement Element(pb_size_t which) {
  heapdump_client_SnapshotElement e = heapdump_client_SnapshotElement_init_zero;
  e.which_element = which;
  return e;
}

TEST(Batch, EveryElementRoundTripsWithFieldsPresent) {
  Capture capture;
  auto w = NewWriter(&capture);
  auto header = Element(heapdump_client_SnapshotElement_snapshot_header_tag);
  header.element.snapshot_header = {true, "proc-name",           true, 4321,
                                    true, "./proc --flag 'a b'", true, "its table stayed locked"};
  ASSERT_EQ(hd_batch_add(w.get(), &header), HD_OK);
  auto alloc = Element(heapdump_client_SnapshotElement_allocation_tag);
  // Sampled (the stats below say so): the block of 24 bytes stands for 2, 48 bytes.
  alloc.element.allocation = {true, 0x1000, true, 48, true, 7, true, -5, true, 3, true, 2};
  ASSERT_EQ(hd_batch_add(w.get(), &alloc), HD_OK);
  auto thread = Element(heapdump_client_SnapshotElement_thread_info_tag);
  thread.element.thread_info = {true, 3, true, 999, true, "worker"};
  ASSERT_EQ(hd_batch_add(w.get(), &thread), HD_OK);
  auto region = Element(heapdump_client_SnapshotElement_executable_region_tag);
  auto &r = region.element.executable_region;
  r.has_address = r.has_size = r.has_file_offset = r.has_build_id = r.has_vaddr = r.has_name = true;
  r.address = 0x400000;
  r.size = 0x2000;
  r.file_offset = 0x1000;
  r.vaddr = 0x1000;
  r.build_id.value.size = 20;
  for (int i = 0; i < 20; i++) r.build_id.value.bytes[i] = static_cast<uint8_t>(i * 7);
  strcpy(r.name, "/usr/bin/demo");
  ASSERT_EQ(hd_batch_add(w.get(), &region), HD_OK);
  const uint64_t addrs[] = {0x400100, UINT64_MAX, 0};
  ASSERT_EQ(hd_batch_add_stack_trace(w.get(), 7, addrs, 3, false), HD_OK);
  const uint8_t bytes[24] = {1, 2, 3, 0, 5};
  ASSERT_EQ(hd_batch_add_block_contents(w.get(), 0x1000, bytes, sizeof bytes), HD_OK);
  auto counters = Element(heapdump_client_SnapshotElement_stack_trace_counters_tag);
  counters.element.stack_trace_counters = {true, 7,    true, 1000, true, 24000, true,
                                           31,   true, 3,    true, 72,   true,  true};
  ASSERT_EQ(hd_batch_add(w.get(), &counters), HD_OK);
  auto stats = Element(heapdump_client_SnapshotElement_process_stats_tag);
  stats.element.process_stats = {
      true, 10, true, 20,     true, 9,    true, 18,
      true, 1,  true, 2,      true, 30,   true, 4,
      true, 5,  true, 6,      true, 11,   true, 12,
      true, 13, true, 14,     true, 77,   true, 72,
      true, 3,  true, 524288, true, 4096, true, heapdump_client_RecordingState_RECORDING_ARMED};
  ASSERT_EQ(hd_batch_add(w.get(), &stats), HD_OK);
  for (int i = 0; i < 2; i++) {
    auto sample = Element(heapdump_client_SnapshotElement_stats_sample_tag);
    sample.element.stats_sample = {true, 1000 + i, true, 64u + i, true, 2,  true,   640,
                                   true, 20,       true, 576,     true, 18, i == 1, "at-peak"};
    ASSERT_EQ(hd_batch_add(w.get(), &sample), HD_OK);
  }
  ASSERT_EQ(hd_batch_end(w.get()), HD_OK);
  ASSERT_EQ(capture.bodies.size(), 2u);  // everything fits in one batch, then the empty one
  EXPECT_TRUE(capture.bodies[1].empty());

  hd_reassembler ra;
  hd_reassembler_init(&ra);
  Deliver(capture, &ra);
  ASSERT_EQ(hd_reassembler_finish(&ra), HD_OK) << ra.error;
  ASSERT_EQ(ra.snapshot_count, 1u);
  const hd_snapshot *s = ra.snapshots[0];
  EXPECT_TRUE(s->has_header);
  EXPECT_STREQ(s->process_name, "proc-name");
  EXPECT_EQ(s->pid, 4321u);
  EXPECT_STREQ(s->command_line, "./proc --flag 'a b'");
  EXPECT_STREQ(s->not_read, "its table stayed locked");
  // Samples stay in the order they came, the snapshot's name only where it was set.
  ASSERT_EQ(s->sample_count, 2u);
  EXPECT_EQ(s->samples[0].timestamp, 1000);
  EXPECT_EQ(s->samples[1].live_bytes, 65u);
  EXPECT_EQ(s->samples[1].blocks_freed, 18u);
  EXPECT_FALSE(s->samples[0].has_snapshot_name);
  EXPECT_STREQ(s->samples[1].snapshot_name, "at-peak");
  const hd_snapshot_allocation *a = hd_snapshot_find_allocation(s, 0x1000);
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->size, 48u);
  EXPECT_EQ(hd_snapshot_block_size(s, a), 24u);
  EXPECT_EQ(a->stack_trace_key, 7u);
  EXPECT_EQ(a->timestamp, -5);
  EXPECT_EQ(a->thread_info_key, 3u);
  EXPECT_EQ(a->count, 2u);
  const hd_snapshot_thread *t = hd_snapshot_find_thread(s, 3);
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->koid, 999u);
  EXPECT_STREQ(t->name, "worker");
  ASSERT_EQ(s->region_count, 1u);
  EXPECT_EQ(s->regions[0].address, 0x400000u);
  EXPECT_EQ(s->regions[0].size, 0x2000u);
  EXPECT_EQ(s->regions[0].file_offset, 0x1000u);
  EXPECT_EQ(s->regions[0].vaddr, 0x1000u);
  ASSERT_EQ(s->regions[0].build_id_size, 20u);
  EXPECT_EQ(s->regions[0].build_id[19], 19 * 7);
  EXPECT_STREQ(s->regions[0].name, "/usr/bin/demo");
  const hd_snapshot_stack_trace *st = hd_snapshot_find_stack_trace(s, 7);
  ASSERT_NE(st, nullptr);
  ASSERT_EQ(st->count, 3u);
  EXPECT_EQ(st->addresses[1], UINT64_MAX);
  EXPECT_EQ(st->addresses[2], 0u);
  EXPECT_TRUE(st->has_counters);
  EXPECT_EQ(st->allocated_blocks, 1000u);
  EXPECT_EQ(st->allocated_bytes, 24000u);
  EXPECT_EQ(st->temporary_blocks, 31u);
  EXPECT_EQ(st->peak_blocks, 3u);
  EXPECT_EQ(st->peak_bytes, 72u);
  EXPECT_TRUE(st->counts_unsettled);
  ASSERT_TRUE(s->has_stats);
  EXPECT_EQ(s->stats.peak_live_bytes, 30u);
  EXPECT_EQ(s->stats.dropped_resources, 6u);
  EXPECT_EQ(s->stats.stacks_beyond_cfi, 11u);
  EXPECT_EQ(s->stats.mapping_records_lost, 13u);
  EXPECT_EQ(s->stats.unwind_tables_refused, 14u);
  EXPECT_EQ(s->stats.peak_mark_time, 77);
  EXPECT_EQ(s->stats.peak_mark_bytes, 72u);
  EXPECT_EQ(s->stats.sample_bytes, 524288u);
  EXPECT_EQ(s->stats.unattributed_bytes, 4096u);
  EXPECT_EQ(s->stats.recording, heapdump_client_RecordingState_RECORDING_ARMED);
  const hd_snapshot_block *b = hd_snapshot_find_block(s, 0x1000);
  ASSERT_NE(b, nullptr);
  ASSERT_EQ(b->size, 24u);
  EXPECT_EQ(memcmp(b->bytes, bytes, 24), 0);
  hd_reassembler_destroy(&ra);
}

TEST(Batch, EveryElementRoundTripsWithFieldsAbsent) {
  Capture capture;
  auto w = NewWriter(&capture);
  for (pb_size_t which : {heapdump_client_SnapshotElement_snapshot_header_tag,
                          heapdump_client_SnapshotElement_thread_info_tag,
                          heapdump_client_SnapshotElement_executable_region_tag,
                          heapdump_client_SnapshotElement_stack_trace_counters_tag,
                          heapdump_client_SnapshotElement_process_stats_tag}) {
    auto e = Element(which);
    ASSERT_EQ(hd_batch_add(w.get(), &e), HD_OK);
  }
  auto alloc = Element(heapdump_client_SnapshotElement_allocation_tag);
  alloc.element.allocation.has_address = true;  // the one field a receiver needs
  ASSERT_EQ(hd_batch_add(w.get(), &alloc), HD_OK);
  ASSERT_EQ(hd_batch_add_stack_trace(w.get(), 0, nullptr, 0, false), HD_OK);
  ASSERT_EQ(hd_batch_end(w.get()), HD_OK);
  hd_reassembler ra;
  hd_reassembler_init(&ra);
  Deliver(capture, &ra);
  ASSERT_EQ(hd_reassembler_finish(&ra), HD_OK) << ra.error;
  const hd_snapshot *s = ra.snapshots[0];
  EXPECT_TRUE(s->has_header);
  EXPECT_STREQ(s->process_name, "");
  const hd_snapshot_allocation *a = hd_snapshot_find_allocation(s, 0);
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->size, 0u);
  EXPECT_EQ(a->count, 1u);  // absent count means one block
  ASSERT_NE(hd_snapshot_find_stack_trace(s, 0), nullptr);
  EXPECT_EQ(hd_snapshot_find_stack_trace(s, 0)->count, 0u);
  ASSERT_EQ(s->region_count, 1u);
  EXPECT_EQ(s->regions[0].build_id_size, 0u);
  EXPECT_TRUE(s->has_stats);
  EXPECT_FALSE(s->stats.has_live_bytes);
  EXPECT_TRUE(hd_snapshot_find_stack_trace(s, 0)->has_counters);
  EXPECT_FALSE(ra.unknown_elements);
  hd_reassembler_destroy(&ra);

  // The element with nothing set encodes to a zero-length variant, and still decodes as one.
  auto empty = Element(heapdump_client_SnapshotElement_allocation_tag);
  size_t size = 0;
  ASSERT_TRUE(pb_get_encoded_size(&size, heapdump_client_SnapshotElement_fields, &empty));
  EXPECT_EQ(size, 2u);
}

TEST(Batch, RandomMixesNeverExceedTheMessageLimit) {
  std::mt19937_64 rng(12345);
  for (int round = 0; round < 6; round++) {
    Capture capture;
    auto w = NewWriter(&capture);
    std::vector<uint64_t> addrs;
    std::vector<uint8_t> bytes;
    for (int i = 0; i < 3000; i++) {
      switch (rng() % 5) {
        case 0: {
          auto e = Element(heapdump_client_SnapshotElement_allocation_tag);
          e.element.allocation = {true, rng(),       true,           rng(),
                                  true, rng() % 100, true,           static_cast<int64_t>(rng()),
                                  true, rng() % 7,   rng() % 2 == 0, 1};
          ASSERT_EQ(hd_batch_add(w.get(), &e), HD_OK);
          break;
        }
        case 1: {
          addrs.resize(rng() % 9000);
          for (auto &a : addrs) a = rng() >> (rng() % 64);
          ASSERT_EQ(
              hd_batch_add_stack_trace(w.get(), rng() % 100, addrs.data(), addrs.size(), false),
              HD_OK);
          break;
        }
        case 2: {
          bytes.resize(rng() % 70000);
          ASSERT_EQ(hd_batch_add_block_contents(w.get(), rng(), bytes.data(), bytes.size()), HD_OK);
          break;
        }
        case 3: {
          auto e = Element(heapdump_client_SnapshotElement_executable_region_tag);
          auto &r = e.element.executable_region;
          r.has_name = true;
          memset(r.name, 'n', rng() % 4096);
          r.has_build_id = true;
          r.build_id.value.size = 32;
          ASSERT_EQ(hd_batch_add(w.get(), &e), HD_OK);
          break;
        }
        default: {
          auto e = Element(heapdump_client_SnapshotElement_thread_info_tag);
          e.element.thread_info = {true, rng(), true, rng(), true, "t"};
          memset(e.element.thread_info.name, 'x', rng() % 32);
          ASSERT_EQ(hd_batch_add(w.get(), &e), HD_OK);
        }
      }
    }
    ASSERT_EQ(hd_batch_end(w.get()), HD_OK);
    size_t fullest = 0;
    for (const auto &body : capture.bodies) {
      ASSERT_LE(body.size() + HD_HEADER_BYTES, HD_MAX_MESSAGE_BYTES);
      fullest = std::max(fullest, body.size());
    }
    // Batches are filled, not cut at a fixed count: most of them come close to the limit.
    EXPECT_GT(fullest, HD_BATCH_CAPACITY - 5000);
  }
}

TEST(Batch, StackTraceFourTimesTheMessageSizeIsChunkedAndReassembled) {
  Capture capture;
  auto w = NewWriter(&capture);
  // 10-byte varints: 4 x 65,536 bytes of addresses.
  std::vector<uint64_t> addrs(4 * HD_MAX_MESSAGE_BYTES / 10);
  for (size_t i = 0; i < addrs.size(); i++) addrs[i] = UINT64_MAX - i;
  auto alloc = Element(heapdump_client_SnapshotElement_allocation_tag);
  alloc.element.allocation = {true, 0x10, true, 1, true, 99, false, 0, true, 1, false, 0};
  auto thread = Element(heapdump_client_SnapshotElement_thread_info_tag);
  thread.element.thread_info = {true, 1, true, 1, true, "main"};
  ASSERT_EQ(hd_batch_add(w.get(), &alloc), HD_OK);
  ASSERT_EQ(hd_batch_add(w.get(), &thread), HD_OK);
  ASSERT_EQ(hd_batch_add_stack_trace(w.get(), 99, addrs.data(), addrs.size(), false), HD_OK);
  ASSERT_EQ(hd_batch_end(w.get()), HD_OK);
  EXPECT_GE(capture.bodies.size(), 5u);
  hd_reassembler ra;
  hd_reassembler_init(&ra);
  size_t largest = Deliver(capture, &ra);
  EXPECT_LE(largest, HD_MAX_MESSAGE_BYTES);
  ASSERT_EQ(hd_reassembler_finish(&ra), HD_OK) << ra.error;
  const hd_snapshot_stack_trace *st = hd_snapshot_find_stack_trace(ra.snapshots[0], 99);
  ASSERT_NE(st, nullptr);
  ASSERT_EQ(st->count, addrs.size());
  EXPECT_EQ(0, memcmp(st->addresses, addrs.data(), addrs.size() * sizeof(uint64_t)));
  hd_reassembler_destroy(&ra);
}

TEST(Batch, SixHundredKilobyteBlockIsChunkedAndReassembled) {
  Capture capture;
  auto w = NewWriter(&capture);
  std::vector<uint8_t> block(600 * 1024);
  std::mt19937 rng(7);
  for (auto &b : block) b = static_cast<uint8_t>(rng());
  auto alloc = Element(heapdump_client_SnapshotElement_allocation_tag);
  alloc.element.allocation = {true, 0xabc0, true, block.size(), true, 1, false,
                              0,    true,   1,    false,        0};
  auto thread = Element(heapdump_client_SnapshotElement_thread_info_tag);
  thread.element.thread_info = {true, 1, true, 1, true, "main"};
  ASSERT_EQ(hd_batch_add(w.get(), &alloc), HD_OK);
  ASSERT_EQ(hd_batch_add(w.get(), &thread), HD_OK);
  ASSERT_EQ(hd_batch_add_stack_trace(w.get(), 1, nullptr, 0, false), HD_OK);
  ASSERT_EQ(hd_batch_add_block_contents(w.get(), 0xabc0, block.data(), block.size()), HD_OK);
  ASSERT_EQ(hd_batch_end(w.get()), HD_OK);
  EXPECT_GE(capture.bodies.size(), 11u);
  hd_reassembler ra;
  hd_reassembler_init(&ra);
  Deliver(capture, &ra);
  ASSERT_EQ(hd_reassembler_finish(&ra), HD_OK) << ra.error;
  const hd_snapshot_block *b = hd_snapshot_find_block(ra.snapshots[0], 0xabc0);
  ASSERT_NE(b, nullptr);
  ASSERT_EQ(b->size, block.size());
  EXPECT_EQ(0, memcmp(b->bytes, block.data(), block.size()));
  hd_reassembler_destroy(&ra);
}

// A batch element as nanopb (and protoc) encodes it: key of field 1, its length, the element.
std::vector<uint8_t> NanopbElement(const heapdump_client_SnapshotElement &e) {
  std::vector<uint8_t> element(HD_BATCH_CAPACITY);
  pb_ostream_t out = pb_ostream_from_buffer(element.data(), element.size());
  EXPECT_TRUE(pb_encode(&out, heapdump_client_SnapshotElement_fields, &e));
  std::vector<uint8_t> framed = {0x0a};
  for (size_t n = out.bytes_written;; n >>= 7) {
    framed.push_back(static_cast<uint8_t>(n < 0x80 ? n : (n & 0x7f) | 0x80));
    if (n < 0x80) break;
  }
  framed.insert(framed.end(), element.begin(), element.begin() + out.bytes_written);
  return framed;
}

struct Bytes {
  const uint8_t *data;
  size_t size;
};

bool EncodeBytes(pb_ostream_t *stream, const pb_field_t *field, void *const *arg) {
  const Bytes *bytes = static_cast<const Bytes *>(*arg);
  return pb_encode_tag_for_field(stream, field) &&
         pb_encode_string(stream, bytes->data, bytes->size);
}

// Allocations and block contents are written without nanopb, one per block: their bytes must be
// the ones nanopb writes, for every field present or absent and every varint length.
TEST(Batch, DirectlyWrittenElementsAreWhatNanopbWrites) {
  std::mt19937_64 rng(99);
  auto value = [&] { return rng() >> (rng() % 64); };
  for (int i = 0; i < 2000; i++) {
    auto e = Element(heapdump_client_SnapshotElement_allocation_tag);
    auto &a = e.element.allocation;
    a = {rng() % 2 == 0, value(),
         rng() % 2 == 0, value(),
         rng() % 2 == 0, value(),
         rng() % 2 == 0, static_cast<int64_t>(value()) * (rng() % 2 ? 1 : -1),
         rng() % 2 == 0, value(),
         rng() % 2 == 0, value()};
    Capture capture;
    auto w = NewWriter(&capture);
    ASSERT_EQ(hd_batch_add_allocation(w.get(), &a), HD_OK);
    ASSERT_EQ(hd_batch_flush(w.get()), HD_OK);
    ASSERT_EQ(capture.bodies.size(), 1u);
    ASSERT_EQ(capture.bodies[0], NanopbElement(e)) << "allocation " << i;
  }
  std::vector<uint8_t> payload(40000);
  for (auto &b : payload) b = static_cast<uint8_t>(rng());
  for (uint64_t address : {uint64_t{0}, uint64_t{1}, uint64_t{0x7fff12345670}, UINT64_MAX}) {
    for (size_t size : {0, 1, 127, 128, 300, 16383, 16384, 40000}) {
      auto e = Element(heapdump_client_SnapshotElement_block_contents_tag);
      e.element.block_contents.has_address = true;
      e.element.block_contents.address = address;
      Bytes bytes = {payload.data(), size};
      e.element.block_contents.contents.funcs.encode = EncodeBytes;
      e.element.block_contents.contents.arg = &bytes;
      Capture capture;
      auto w = NewWriter(&capture);
      ASSERT_EQ(hd_batch_add_block_contents(w.get(), address, payload.data(), size), HD_OK);
      ASSERT_EQ(hd_batch_flush(w.get()), HD_OK);
      ASSERT_EQ(capture.bodies.size(), 1u);
      ASSERT_EQ(capture.bodies[0], NanopbElement(e)) << address << " " << size;
    }
  }
}

TEST(Batch, ContentsChunksFillEveryBatchButTheLast) {
  Capture capture;
  auto w = NewWriter(&capture);
  std::vector<uint8_t> block(600 * 1024, 0x5a);
  ASSERT_EQ(hd_batch_add_block_contents(w.get(), 0x7fff00001230, block.data(), block.size()),
            HD_OK);
  ASSERT_EQ(hd_batch_end(w.get()), HD_OK);
  ASSERT_GE(capture.bodies.size(), 11u);
  // A chunk one byte longer would not fit: its lengths grow by at most one byte each.
  for (size_t i = 0; i + 2 < capture.bodies.size(); i++) {
    EXPECT_GE(capture.bodies[i].size(), HD_BATCH_CAPACITY - 3) << "batch " << i;
    EXPECT_LE(capture.bodies[i].size(), HD_BATCH_CAPACITY) << "batch " << i;
  }
}

// What a reader passed on for one element.
struct Decoded {
  pb_size_t which = 0;
  heapdump_client_Allocation allocation = heapdump_client_Allocation_init_zero;
  uint64_t address = 0;
  std::vector<uint8_t> contents;
};

hd_status Record(void *ctx, const hd_element *e) {
  Decoded d;
  d.which = e->element->which_element;
  if (d.which == heapdump_client_SnapshotElement_allocation_tag) {
    d.allocation = e->element->element.allocation;
  } else if (d.which == heapdump_client_SnapshotElement_block_contents_tag) {
    d.address = e->element->element.block_contents.address;
    d.contents.assign(e->contents, e->contents + e->contents_size);
  }
  static_cast<std::vector<Decoded> *>(ctx)->push_back(d);
  return HD_OK;
}

hd_status DecodeBody(const std::vector<uint8_t> &body, std::vector<Decoded> *out) {
  auto msg = NewMessage();
  msg->size = HD_HEADER_BYTES + body.size();
  memcpy(msg->bytes + HD_HEADER_BYTES, body.data(), body.size());
  auto reader = std::make_unique<hd_batch_reader>();
  hd_batch_reader_init(reader.get(), Record, out);
  return hd_batch_reader_decode(reader.get(), msg.get());
}

// Allocations and block contents are decoded without nanopb when they look as writers make them;
// anything else still decodes as protobuf says (nanopb does it), or is refused.
TEST(Batch, ReaderDecodesUnusualPerBlockElementsAsProtobufSays) {
  std::vector<Decoded> got;
  // Allocation {address 5, an unknown field 9, size 7}: the unknown field is skipped.
  ASSERT_EQ(DecodeBody({0x0a, 0x08, 0x0a, 0x06, 0x08, 0x05, 0x48, 0x01, 0x10, 0x07}, &got), HD_OK);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].which, heapdump_client_SnapshotElement_allocation_tag);
  EXPECT_TRUE(got[0].allocation.has_address && got[0].allocation.has_size);
  EXPECT_EQ(got[0].allocation.address, 5u);
  EXPECT_EQ(got[0].allocation.size, 7u);
  EXPECT_FALSE(got[0].allocation.has_count);
  // The address twice, the second one a non-minimal varint: the last one counts.
  got.clear();
  ASSERT_EQ(DecodeBody({0x0a, 0x07, 0x0a, 0x05, 0x08, 0x05, 0x08, 0x81, 0x00}, &got), HD_OK);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].allocation.address, 1u);
  // Two variants in one element: the last one counts.
  got.clear();
  ASSERT_EQ(DecodeBody({0x0a, 0x08, 0x0a, 0x02, 0x08, 0x05, 0x2a, 0x02, 0x08, 0x03}, &got), HD_OK);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].which, heapdump_client_SnapshotElement_thread_info_tag);
  // BlockContents with its payload in two fields: they are concatenated.
  got.clear();
  ASSERT_EQ(
      DecodeBody({0x0a, 0x0b, 0x22, 0x09, 0x08, 0x10, 0x12, 0x02, 'a', 'b', 0x12, 0x01, 'c'}, &got),
      HD_OK);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].which, heapdump_client_SnapshotElement_block_contents_tag);
  EXPECT_EQ(got[0].address, 0x10u);
  EXPECT_EQ(got[0].contents, (std::vector<uint8_t>{'a', 'b', 'c'}));
  // Refused: an address of the wrong wire type, an eleven-byte varint, a payload past its end.
  got.clear();
  EXPECT_EQ(DecodeBody({0x0a, 0x05, 0x0a, 0x03, 0x0a, 0x01, 0x00}, &got), HD_ERR_DECODE);
  EXPECT_EQ(DecodeBody({0x0a, 0x0e, 0x0a, 0x0c, 0x08, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
                        0xff, 0xff, 0xff, 0x01},
                       &got),
            HD_ERR_DECODE);
  EXPECT_EQ(DecodeBody({0x0a, 0x06, 0x22, 0x04, 0x12, 0x05, 'a', 'b'}, &got), HD_ERR_DECODE);
  EXPECT_TRUE(got.empty());
}

// The channel sender leaves up to HD_BATCH_WINDOW batches unanswered (one, as the protocol has it),
// and no more. Its end is non-blocking here, so that a wait for an answer that has not come fails
// at once (HD_ERR_TIMED_OUT, as a timeout of zero).
TEST(Batch, ChannelSenderKeepsAWindowOfUnansweredBatches) {
  Pair pair;
  ASSERT_EQ(fcntl(pair.a, F_SETFL, O_NONBLOCK), 0);
  auto scratch = NewMessage();
  hd_batch_channel ch;
  hd_batch_channel_init(&ch, pair.a, scratch.get());
  const uint8_t body[] = {0x0a, 0x00};  // one element with nothing set
  for (unsigned i = 0; i < HD_BATCH_WINDOW; i++) {
    ASSERT_EQ(hd_batch_send_on_channel(&ch, body, sizeof body), HD_OK);
  }
  EXPECT_EQ(hd_batch_send_on_channel(&ch, body, sizeof body), HD_ERR_TIMED_OUT);
  auto in = NewMessage();
  std::vector<uint32_t> txids;
  for (unsigned i = 0; i < HD_BATCH_WINDOW; i++) {
    ASSERT_EQ(hd_message_recv(pair.b, in.get()), HD_OK);
    EXPECT_EQ(in->ordinal, HD_ORDINAL_SNAPSHOT_RECEIVER_BATCH);
    EXPECT_EQ(std::count(txids.begin(), txids.end(), in->txid), 0);
    txids.push_back(in->txid);
  }
  char more;
  EXPECT_EQ(recv(pair.b, &more, 1, MSG_DONTWAIT), -1) << "a batch beyond the window was sent";
  heapdump_client_Empty empty = heapdump_client_Empty_init_zero;
  // One answer, to the latest batch, opens the window by one.
  ASSERT_EQ(hd_fidl_snapshot_receiver_batch_reply(pair.b, in.get(), txids.back(), &empty), HD_OK);
  txids.pop_back();
  ASSERT_EQ(hd_batch_send_on_channel(&ch, body, sizeof body), HD_OK);
  ASSERT_EQ(hd_message_recv(pair.b, in.get()), HD_OK);
  txids.push_back(in->txid);
  // Answers in any order; drain consumes every one.
  EXPECT_EQ(hd_batch_channel_drain(&ch), HD_ERR_TIMED_OUT);
  for (auto it = txids.rbegin(); it != txids.rend(); ++it) {
    ASSERT_EQ(hd_fidl_snapshot_receiver_batch_reply(pair.b, in.get(), *it, &empty), HD_OK);
  }
  EXPECT_EQ(hd_batch_channel_drain(&ch), HD_OK);
  EXPECT_EQ(ch.unanswered_count, 0u);
  // The empty batch waits for its own answer too.
  EXPECT_EQ(hd_batch_send_on_channel(&ch, body, 0), HD_ERR_TIMED_OUT);
  ASSERT_EQ(hd_message_recv(pair.b, in.get()), HD_OK);
  EXPECT_EQ(in->size, HD_HEADER_BYTES);
  ASSERT_EQ(hd_fidl_snapshot_receiver_batch_reply(pair.b, in.get(), in->txid, &empty), HD_OK);
  EXPECT_EQ(hd_batch_channel_drain(&ch), HD_OK);
  // An answer to a call never made is refused.
  ASSERT_EQ(hd_batch_send_on_channel(&ch, body, sizeof body), HD_OK);
  ASSERT_EQ(hd_message_recv(pair.b, in.get()), HD_OK);
  ASSERT_EQ(hd_fidl_snapshot_receiver_batch_reply(pair.b, in.get(), in->txid + 1, &empty), HD_OK);
  EXPECT_EQ(hd_batch_channel_drain(&ch), HD_ERR_UNEXPECTED_MESSAGE);
}

TEST(Reassembler, SkipsUnknownVariantsOfTheFlexibleUnion) {
  // One element of a variant from a newer sender (field 15, an empty message), then a thread.
  std::vector<uint8_t> body = {0x0a, 0x02, 0x7a, 0x00, 0x0a, 0x06,
                               0x2a, 0x04, 0x08, 0x01, 0x10, 0x02};
  auto msg = NewMessage();
  msg->size = HD_HEADER_BYTES + body.size();
  memcpy(msg->bytes + HD_HEADER_BYTES, body.data(), body.size());
  hd_reassembler ra;
  hd_reassembler_init(&ra);
  auto reader = std::make_unique<hd_batch_reader>();
  hd_batch_reader_init(reader.get(), hd_reassembler_add, &ra);
  ASSERT_EQ(hd_batch_reader_decode(reader.get(), msg.get()), HD_OK);
  EXPECT_EQ(reader->element_count, 2u);
  EXPECT_EQ(ra.unknown_elements, 1u);
  ASSERT_NE(hd_snapshot_find_thread(ra.snapshots[0], 1), nullptr);
  EXPECT_EQ(hd_snapshot_find_thread(ra.snapshots[0], 1)->koid, 2u);
  hd_reassembler_destroy(&ra);
}

// Contents kept in a spill file (as the CLI keeps them, so that they need not fit in memory) come
// out as kept in memory, even when chunks of two blocks interleave in the stream.
TEST(Reassembler, SpilledContentsAreTheSameAsInMemory) {
  Capture capture;
  auto w = NewWriter(&capture);
  for (auto [address, size] : {std::pair<uint64_t, uint64_t>{0x10, 12}, {0x20, 6}}) {
    auto e = Element(heapdump_client_SnapshotElement_allocation_tag);
    e.element.allocation = {true, address, true, size, true, 1, false, 0, true, 1, false, 0};
    ASSERT_EQ(hd_batch_add(w.get(), &e), HD_OK);
  }
  auto t = Element(heapdump_client_SnapshotElement_thread_info_tag);
  t.element.thread_info = {true, 1, true, 1, true, "main"};
  ASSERT_EQ(hd_batch_add(w.get(), &t), HD_OK);
  ASSERT_EQ(hd_batch_add_stack_trace(w.get(), 1, nullptr, 0, false), HD_OK);
  const std::string a1 = "abcd", b = "uvwxyz", a2 = "efghijkl";
  ASSERT_EQ(hd_batch_add_block_contents(w.get(), 0x10, reinterpret_cast<const uint8_t *>(a1.data()),
                                        a1.size()),
            HD_OK);
  ASSERT_EQ(hd_batch_add_block_contents(w.get(), 0x20, reinterpret_cast<const uint8_t *>(b.data()),
                                        b.size()),
            HD_OK);
  ASSERT_EQ(hd_batch_add_block_contents(w.get(), 0x10, reinterpret_cast<const uint8_t *>(a2.data()),
                                        a2.size()),
            HD_OK);
  ASSERT_EQ(hd_batch_end(w.get()), HD_OK);
  for (bool spill : {false, true}) {
    hd_reassembler ra;
    hd_reassembler_init(&ra);
    if (spill) hd_reassembler_spill_contents(&ra, memfd_create("spill", MFD_CLOEXEC));
    hd_status delivered = HD_OK;
    Deliver(capture, &ra, &delivered);
    ASSERT_EQ(delivered, HD_OK) << ra.error;
    ASSERT_EQ(hd_reassembler_finish(&ra), HD_OK) << ra.error;
    const hd_snapshot_block *first = hd_snapshot_find_block(ra.snapshots[0], 0x10);
    const hd_snapshot_block *second = hd_snapshot_find_block(ra.snapshots[0], 0x20);
    ASSERT_TRUE(first != nullptr && second != nullptr);
    EXPECT_EQ(std::string(reinterpret_cast<const char *>(first->bytes), first->size), a1 + a2)
        << spill;
    EXPECT_EQ(std::string(reinterpret_cast<const char *>(second->bytes), second->size), b) << spill;
    hd_reassembler_destroy(&ra);
  }
}

heapdump_client_RootRegion Root(uint64_t address, uint64_t size, heapdump_client_RootKind kind) {
  heapdump_client_RootRegion root = heapdump_client_RootRegion_init_zero;
  root.has_address = root.has_size = root.has_kind = true;
  root.address = address;
  root.size = size;
  root.kind = kind;
  return root;
}

// Root regions (reachability roots) bigger than a message come in chunks, each with the region's
// fields; interleaved with block contents and with each other, kept in memory or spilled, they
// reassemble to their bytes. A receiver that does not know them would skip them (a flexible
// union), which the reassembler's count of unknown elements stands for here: it knows them.
TEST(Reassembler, RootRegionsAreChunkedAndReassembled) {
  Capture capture;
  auto w = NewWriter(&capture);
  auto e = Element(heapdump_client_SnapshotElement_allocation_tag);
  e.element.allocation = {true, 0x10, true, 4, true, 1, false, 0, true, 1, false, 0};
  ASSERT_EQ(hd_batch_add(w.get(), &e), HD_OK);
  auto t = Element(heapdump_client_SnapshotElement_thread_info_tag);
  t.element.thread_info = {true, 1, true, 1, true, "main"};
  ASSERT_EQ(hd_batch_add(w.get(), &t), HD_OK);
  ASSERT_EQ(hd_batch_add_stack_trace(w.get(), 1, nullptr, 0, false), HD_OK);
  std::vector<uint8_t> data(3 * HD_MAX_MESSAGE_BYTES + 5), stack(1000);
  std::mt19937 rng(3);
  for (auto &b : data) b = static_cast<uint8_t>(rng());
  for (auto &b : stack) b = static_cast<uint8_t>(rng());
  heapdump_client_RootRegion data_root =
      Root(0x600000, data.size(), heapdump_client_RootKind_ROOT_KIND_DATA);
  data_root.has_name = true;
  snprintf(data_root.name, sizeof data_root.name, "/usr/lib/libexample.so");
  heapdump_client_RootRegion stack_root =
      Root(0x7ffd0000, stack.size(), heapdump_client_RootKind_ROOT_KIND_STACK);
  stack_root.has_thread_koid = true;
  stack_root.thread_koid = 4242;
  const uint8_t block[4] = {1, 2, 3, 4};
  ASSERT_EQ(hd_batch_add_root_region(w.get(), &data_root, data.data(), 70000), HD_OK);
  ASSERT_EQ(hd_batch_add_block_contents(w.get(), 0x10, block, 4), HD_OK);
  ASSERT_EQ(hd_batch_add_root_region(w.get(), &stack_root, stack.data(), stack.size()), HD_OK);
  ASSERT_EQ(hd_batch_add_root_region(w.get(), &data_root, data.data() + 70000, data.size() - 70000),
            HD_OK);
  ASSERT_EQ(hd_batch_end(w.get()), HD_OK);
  for (bool spill : {false, true}) {
    hd_reassembler ra;
    hd_reassembler_init(&ra);
    if (spill) hd_reassembler_spill_contents(&ra, memfd_create("spill", MFD_CLOEXEC));
    hd_status delivered = HD_OK;
    size_t largest = Deliver(capture, &ra, &delivered);
    EXPECT_LE(largest, HD_MAX_MESSAGE_BYTES);
    ASSERT_EQ(delivered, HD_OK) << ra.error;
    ASSERT_EQ(hd_reassembler_finish(&ra), HD_OK) << ra.error;
    EXPECT_EQ(ra.unknown_elements, 0u);
    const hd_snapshot *s = ra.snapshots[0];
    ASSERT_EQ(s->root_count, 2u);
    const hd_snapshot_root *d = hd_snapshot_find_root(s, 0x600000);
    const hd_snapshot_root *k = hd_snapshot_find_root(s, 0x7ffd0000);
    ASSERT_TRUE(d != nullptr && k != nullptr);
    EXPECT_EQ(d->kind, heapdump_client_RootKind_ROOT_KIND_DATA);
    EXPECT_STREQ(d->name, "/usr/lib/libexample.so");
    ASSERT_EQ(d->contents.size, data.size()) << spill;
    EXPECT_EQ(0, memcmp(d->contents.bytes, data.data(), data.size())) << spill;
    EXPECT_EQ(k->kind, heapdump_client_RootKind_ROOT_KIND_STACK);
    EXPECT_EQ(k->thread_koid, 4242u);
    EXPECT_STREQ(k->name, "");
    ASSERT_EQ(k->contents.size, stack.size());
    EXPECT_EQ(0, memcmp(k->contents.bytes, stack.data(), stack.size())) << spill;
    const hd_snapshot_block *b = hd_snapshot_find_block(s, 0x10);
    ASSERT_NE(b, nullptr);
    EXPECT_EQ(0, memcmp(b->bytes, block, 4));
    hd_reassembler_destroy(&ra);
  }
}

TEST(Reassembler, RejectsInconsistentStreams) {
  struct Case {
    const char *what;
    std::function<void(hd_batch_writer *)> fill;
  };
  auto alloc = [](hd_batch_writer *w, uint64_t address, uint64_t size) {
    auto e = Element(heapdump_client_SnapshotElement_allocation_tag);
    e.element.allocation = {true, address, true, size, true, 1, false, 0, true, 1, false, 0};
    ASSERT_EQ(hd_batch_add(w, &e), HD_OK);
  };
  auto refs = [](hd_batch_writer *w) {
    auto t = Element(heapdump_client_SnapshotElement_thread_info_tag);
    t.element.thread_info = {true, 1, true, 1, true, "main"};
    ASSERT_EQ(hd_batch_add(w, &t), HD_OK);
    ASSERT_EQ(hd_batch_add_stack_trace(w, 1, nullptr, 0, false), HD_OK);
  };
  const uint8_t bytes[16] = {};
  std::vector<Case> cases = {
      {"contents shorter than the block",
       [&](hd_batch_writer *w) {
         alloc(w, 0x10, 16);
         refs(w);
         ASSERT_EQ(hd_batch_add_block_contents(w, 0x10, bytes, 8), HD_OK);
       }},
      {"contents for an unknown block",
       [&](hd_batch_writer *w) {
         refs(w);
         ASSERT_EQ(hd_batch_add_block_contents(w, 0x10, bytes, 8), HD_OK);
       }},
      {"duplicate address",
       [&](hd_batch_writer *w) {
         alloc(w, 0x10, 16);
         alloc(w, 0x10, 16);
         refs(w);
       }},
      {"dangling stack trace", [&](hd_batch_writer *w) { alloc(w, 0x10, 16); }},
      {"root contents shorter than the root",
       [&](hd_batch_writer *w) {
         heapdump_client_RootRegion root =
             Root(0x1000, 16, heapdump_client_RootKind_ROOT_KIND_DATA);
         ASSERT_EQ(hd_batch_add_root_region(w, &root, bytes, 8), HD_OK);
       }},
      {"root chunks that disagree",
       [&](hd_batch_writer *w) {
         heapdump_client_RootRegion root =
             Root(0x1000, 16, heapdump_client_RootKind_ROOT_KIND_DATA);
         ASSERT_EQ(hd_batch_add_root_region(w, &root, bytes, 8), HD_OK);
         root.kind = heapdump_client_RootKind_ROOT_KIND_STACK;
         ASSERT_EQ(hd_batch_add_root_region(w, &root, bytes, 8), HD_OK);
       }},
      {"root contents longer than the root",
       [&](hd_batch_writer *w) {
         heapdump_client_RootRegion root = Root(0x1000, 8, heapdump_client_RootKind_ROOT_KIND_DATA);
         ASSERT_EQ(hd_batch_add_root_region(w, &root, bytes, 16), HD_OK);
       }},
      {"a stats sample without its moment",
       [&](hd_batch_writer *w) {
         auto sample = Element(heapdump_client_SnapshotElement_stats_sample_tag);
         sample.element.stats_sample.has_live_bytes = true;
         ASSERT_EQ(hd_batch_add(w, &sample), HD_OK);
       }},
  };
  for (const auto &c : cases) {
    Capture capture;
    auto w = NewWriter(&capture);
    c.fill(w.get());
    ASSERT_EQ(hd_batch_end(w.get()), HD_OK);
    hd_reassembler ra;
    hd_reassembler_init(&ra);
    hd_status delivered = HD_OK;
    Deliver(capture, &ra, &delivered);
    hd_status status = delivered != HD_OK ? delivered : hd_reassembler_finish(&ra);
    EXPECT_EQ(status, HD_ERR_REASSEMBLY) << c.what;
    EXPECT_STRNE(ra.error, "") << c.what;
    hd_reassembler_destroy(&ra);
  }
}

}  // namespace
