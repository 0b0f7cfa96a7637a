// fake-gpu-plugin is a Kubernetes device plugin that advertises N fake GPUs (nvidia.com/gpu by default) through the
// real device-plugin API, so the scheduler and kubelet account for GPUs exactly as on a GPU node. Allocate hands the
// container NVIDIA_VISIBLE_DEVICES with the fake device IDs and nothing else: there is no device to mount.
//
// It registers with the kubelet's socket in --dir and registers again whenever the kubelet restarts (a restarting
// kubelet removes every plugin socket in that directory).
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"net"
	"os"
	"path/filepath"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

type plugin struct {
	pluginapi.UnimplementedDevicePluginServer
	devices []*pluginapi.Device
}

func (p *plugin) GetDevicePluginOptions(context.Context, *pluginapi.Empty) (*pluginapi.DevicePluginOptions, error) {
	return &pluginapi.DevicePluginOptions{}, nil
}

// ListAndWatch sends the device list once; the fake devices never change health.
func (p *plugin) ListAndWatch(_ *pluginapi.Empty, stream pluginapi.DevicePlugin_ListAndWatchServer) error {
	if err := stream.Send(&pluginapi.ListAndWatchResponse{Devices: p.devices}); err != nil {
		return err
	}
	<-stream.Context().Done()
	return nil
}

func (p *plugin) Allocate(_ context.Context, req *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	resp := &pluginapi.AllocateResponse{}
	for _, c := range req.ContainerRequests {
		resp.ContainerResponses = append(resp.ContainerResponses, &pluginapi.ContainerAllocateResponse{
			Envs: map[string]string{"NVIDIA_VISIBLE_DEVICES": strings.Join(c.DevicesIds, ",")},
		})
	}
	return resp, nil
}

func (p *plugin) PreStartContainer(context.Context, *pluginapi.PreStartContainerRequest) (*pluginapi.PreStartContainerResponse, error) {
	return &pluginapi.PreStartContainerResponse{}, nil
}

func (p *plugin) GetPreferredAllocation(context.Context, *pluginapi.PreferredAllocationRequest) (*pluginapi.PreferredAllocationResponse, error) {
	return &pluginapi.PreferredAllocationResponse{}, nil
}

// serve starts the plugin's gRPC server on its socket and registers it with the kubelet.
func serve(dir, socketName, resource string, p *plugin) (*grpc.Server, error) {
	socket := filepath.Join(dir, socketName)
	_ = os.Remove(socket)
	listener, err := net.Listen("unix", socket)
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", socket, err)
	}
	server := grpc.NewServer()
	pluginapi.RegisterDevicePluginServer(server, p)
	go func() { _ = server.Serve(listener) }()

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	conn, err := grpc.NewClient("unix://"+filepath.Join(dir, "kubelet.sock"),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		server.Stop()
		return nil, fmt.Errorf("connect to the kubelet: %w", err)
	}
	defer conn.Close()
	_, err = pluginapi.NewRegistrationClient(conn).Register(ctx, &pluginapi.RegisterRequest{
		Version:      pluginapi.Version,
		Endpoint:     socketName,
		ResourceName: resource,
	})
	if err != nil {
		server.Stop()
		return nil, fmt.Errorf("register with the kubelet: %w", err)
	}
	return server, nil
}

func main() {
	count := flag.Int("count", 8, "how many fake devices to advertise")
	resource := flag.String("resource", "nvidia.com/gpu", "the extended resource name")
	dir := flag.String("dir", pluginapi.DevicePluginPath, "the kubelet's device-plugin directory")
	flag.Parse()

	p := &plugin{}
	for i := 0; i < *count; i++ {
		p.devices = append(p.devices, &pluginapi.Device{ID: fmt.Sprintf("fake-gpu-%d", i), Health: pluginapi.Healthy})
	}
	socketName := "ftjob-fake-gpu.sock"
	var server *grpc.Server
	for {
		if server != nil {
			if _, err := os.Stat(filepath.Join(*dir, socketName)); err != nil {
				log.Printf("plugin socket gone (kubelet restarted): registering again")
				server.Stop()
				server = nil
			}
		}
		if server == nil {
			s, err := serve(*dir, socketName, *resource, p)
			if err != nil {
				log.Printf("not registered yet: %v", err)
			} else {
				log.Printf("registered %d x %s with the kubelet", *count, *resource)
				server = s
			}
		}
		time.Sleep(time.Second) // the poll interval of the registration watch
	}
}
